"""The Hopper GEMM (cuda/gemm_sm90.cu) on the CPU emulation (tests/kernel_emu:
driver_sm90.cpp with ptx_emu.h's cp.async and wgmma_emu.h's warpgroup MMA, written to
the PTX ISA's descriptor, layout and fragment definitions): against its NumPy twin on
fresh random inputs with the output poisoned first; every row bit-identical to the
same row at another M, under every tile configuration (DESIGN §4); the launcher's
checks, dispatch predicate and geometry. Its sm_90a build (wgmma in the SASS) is in
test_gemm_sm90_compile.py; the device run in test_gpu_gemm_sm90.py."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from reprise.cuda import pdl
from reprise.cuda.dtypes import BF16, F32, to_bf16
from reprise.cuda.gemm import fold_partials, gemm_ref, split_bounds
from reprise.cuda.gemm_kernel import split_k, split_length
from reprise.cuda.gemm_sm90_kernel import (
    PACK_ROWS,
    PackedWeight,
    gemm_sm90,
    prepare_weight,
    supported,
)
from reprise.cuda.gemm_sm90_plan import (
    CONFIGS,
    SPLIT_ROUTES,
    WG1,
    WG2,
    WG2_WIDE,
    WS,
    WS_DECODE,
    WS_M64,
    WS_TALL,
    WS_WIDE,
    Sm90Config,
    Sm90Launch,
    Sm90WsConfig,
    decode_waves,
    epilogue_launch,
    grid,
    l2_cost,
    launch_plan,
    tile_config,
    waves,
)

pytestmark = pytest.mark.kernels
EMU = Path(__file__).parent / "kernel_emu"
GUARD = 64  # poisoned elements past the output, which must stay poisoned
LLAMA_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
LM_HEAD_8B = (128256, 4096)


def build_driver(tmp_path_factory: pytest.TempPathFactory, *defines: str) -> ctypes.CDLL:
    """driver_sm90.cpp built by g++ into a library of its own (`defines`: -D options)."""
    if shutil.which("g++") is None:
        if os.environ.get("CI"):  # CI installs it: missing there is a failure, not a skip
            pytest.fail("the kernel emulation needs g++")
        pytest.skip("needs g++")
    out = tmp_path_factory.mktemp("emu_sm90") / "libgemm_sm90.so"
    cmd = ["g++", "-std=c++20", "-O1", "-shared", "-fPIC", f"-I{EMU / 'include'}", *defines,
           "-o", str(out), str(EMU / "driver_sm90.cpp")]  # fmt: skip
    built = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr
    return ctypes.CDLL(str(out))


@pytest.fixture
def ws_decodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """WS at every M <= 64 (gemm_sm90_plan's DECODE_TILE_BY_DEFAULT and
    M64_TILE_BY_DEFAULT off): the tests of WS's own grid, and the baseline the two decode
    tiles are compared with."""
    from reprise.cuda import gemm_sm90_plan as geometry

    monkeypatch.setattr(geometry, "DECODE_TILE_BY_DEFAULT", False)
    monkeypatch.setattr(geometry, "M64_TILE_BY_DEFAULT", False)


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """The emulation as the launcher builds the kernel: the 128-byte swizzle."""
    return build_driver(tmp_path_factory)


@pytest.fixture(scope="module")
def lib_interleave(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """The emulation with the ws kernels on the no-swizzle layout (REPRISE_WS_SWIZZLE=0,
    prepare_weight(swizzle=False))."""
    return build_driver(tmp_path_factory, "-DREPRISE_WS_SWIZZLE=0")


@pytest.fixture(scope="module")
def lib_pad_every_tile(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL:
    """The emulation with the ws kernels' rows past M zero-filled every k-tile and every
    consumer computing (REPRISE_WS_PAD_ONCE=0: bench_gemm_sm90's same-run baseline)."""
    return build_driver(tmp_path_factory, "-DREPRISE_WS_PAD_ONCE=0")


def ptr(a: np.ndarray) -> ctypes.c_void_p:
    return a.ctypes.data_as(ctypes.c_void_p)


def bits(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.uint16 if a.dtype in (BF16, np.uint16) else np.uint32)


def poisoned(shape: tuple[int, ...], dtype: type) -> np.ndarray:
    out = np.empty(shape, dtype=dtype)
    out.view(np.uint8).fill(0xFF)
    return out


def emulated(
    lib: ctypes.CDLL, config: Sm90Config, x: np.ndarray, w: np.ndarray, *, out_f32: bool,
    x_shift: int = 0, y_shift: int = 0,
) -> np.ndarray:  # fmt: skip
    """gemm_sm90.cu's entry point for `config`, launched as gemm_sm90 launches it;
    `x_shift` / `y_shift` elements move x / y off 16-byte alignment (the plain-load and
    scalar-store routes)."""
    (m, k), n = x.shape, w.shape[0]
    x_buf = np.empty(m * k + x_shift, np.uint16)
    x_buf[x_shift:] = x.view(np.uint16).reshape(-1)
    dtype = np.float32 if out_f32 else np.uint16
    y_buf = poisoned((m * n + y_shift + GUARD,), dtype)
    y = y_buf[y_shift : y_shift + m * n]
    w_bits = np.ascontiguousarray(w).view(np.uint16)
    rc = lib.run_gemm_sm90(
        config.kernel_name(out_f32).encode(), *grid(config, m, n), config.num_threads,
        config.smem_bytes, ptr(x_buf[x_shift:]), ptr(w_bits), ptr(y), m, n, k,
    )  # fmt: skip
    assert rc == 0, rc
    assert np.array_equal(bits(y_buf[:y_shift]), bits(poisoned((y_shift,), dtype)))
    assert np.array_equal(bits(y_buf[y_shift + m * n :]), bits(poisoned((GUARD,), dtype)))
    return y.reshape(m, n).view(F32 if out_f32 else BF16)


def emulated_ws(
    lib: ctypes.CDLL, x: np.ndarray, w: np.ndarray, *, out_f32: bool, x_shift: int = 0,
    wide: bool = False, swizzle: bool = True, decode: bool = False, m64: bool = False,
) -> np.ndarray:  # fmt: skip
    """A warp-specialized WHOLE entry point (WS, WS_WIDE with `wide`, WS_DECODE with
    `decode`, WS_M64 with `m64`) on `prepare_weight(w, swizzle=swizzle)`, launched as
    gemm_sm90 launches it; the output poisoned, with a guard past its end."""
    (m, k), n = x.shape, w.shape[0]
    config = WS_WIDE if wide else WS_DECODE if decode else WS_M64 if m64 else WS
    packed = prepare_weight(np.ascontiguousarray(w).view(np.uint16), swizzle=swizzle)
    x_buf = np.empty(m * k + x_shift, np.uint16)
    x_buf[x_shift:] = x.view(np.uint16).reshape(-1)
    dtype = np.float32 if out_f32 else np.uint16
    y_buf = poisoned((m * n + GUARD,), dtype)
    rc = lib.run_gemm_sm90_ws(
        int(out_f32), 1 if wide else 2 if decode else 3 if m64 else 0, *grid(config, m, n),
        config.num_threads,
        config.smem_bytes,
        ptr(x_buf[x_shift:]), ptr(packed.data), ptr(y_buf), m, n, k,
    )  # fmt: skip
    assert rc == 0, rc
    assert np.array_equal(bits(y_buf[m * n :]), bits(poisoned((GUARD,), dtype)))
    return y_buf[: m * n].reshape(m, n).view(F32 if out_f32 else BF16)


def check_twin(got: np.ndarray, x: np.ndarray, w: np.ndarray, *, out_f32: bool) -> None:
    """As test_kernels_emulated's GEMM check: within one BF16 rounding of the row's
    largest (BF16 out) or 1e-5 of it (fp32 out) of the twin, every element written."""
    want = gemm_ref(x, w, out_f32=out_f32)
    g, t = got.astype(np.float64), want.astype(np.float64)
    assert not np.isnan(g).any()
    scale = np.max(np.abs(t), axis=-1, keepdims=True)
    if out_f32:
        assert float(np.max(np.abs(g - t) / scale)) <= 1e-5
    else:
        ulp = np.exp2(np.floor(np.log2(np.maximum(scale, 1e-30))) - 7)
        assert float(np.max(np.abs(g - t) / ulp)) <= 1


def operands(rng: np.random.Generator, m: int, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """BF16 rows of mixed scale, and a weight."""
    x = (rng.standard_normal((m, k)) * np.exp2(rng.integers(-3, 4, (m, 1)))).astype(BF16)
    return x, (rng.standard_normal((n, k)) * 0.5).astype(BF16)


# (M, N, K): tails in M and N; N and K at the tile limits (one k-tile, exact tiles,
# one column past a tile, a lone column); K of more k-tiles than any ring has slots,
# so every slot is refilled.
SHAPES = [
    (96, 200, 640),
    (70, 300, 192),
    (130, 257, 128),
    (64, 128, 64),
    (128, 256, 64),
    (3, 129, 64),
    (65, 1, 128),
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_matches_its_twin(
    lib: ctypes.CDLL, rng: np.random.Generator, config: Sm90Config, shape: tuple[int, int, int]
) -> None:
    m, n, k = shape
    x, w = operands(rng, m, n, k)
    for out_f32 in (False, True):
        check_twin(emulated(lib, config, x, w, out_f32=out_f32), x, w, out_f32=out_f32)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.name)
def test_unaligned_operands_take_the_same_values(
    lib: ctypes.CDLL, rng: np.random.Generator, config: Sm90Config
) -> None:
    x, w = operands(rng, 19, 140, 128)
    for out_f32 in (False, True):
        aligned = emulated(lib, config, x, w, out_f32=out_f32)
        check_twin(aligned, x, w, out_f32=out_f32)
        shifted = emulated(lib, config, x, w, out_f32=out_f32, x_shift=1, y_shift=1)
        assert np.array_equal(bits(shifted), bits(aligned))


def test_rows_do_not_depend_on_m(lib: ctypes.CDLL, rng: np.random.Generator) -> None:
    """Rows of M = 1, 7, 64 and 200 calls, in the config the launcher picks for each M and
    in every config, bit-equal the same rows of an M = 256 call: padding rows, companion
    rows, the row's place in its tile and the tiling never reach a row's result."""
    x, w = operands(rng, 256, 272, 128)
    for out_f32 in (False, True):
        full = emulated(lib, tile_config(256, 272), x, w, out_f32=out_f32)
        check_twin(full, x, w, out_f32=out_f32)
        for m, start in ((1, 0), (1, 255), (7, 100), (64, 3), (200, 41)):
            rows = slice(start, start + m)
            configs = {tile_config(m, 272), *CONFIGS}
            for config in configs:
                part = emulated(lib, config, x[rows], w, out_f32=out_f32)
                assert np.array_equal(bits(part), bits(full[rows])), (
                    m,
                    start,
                    config.name,
                    out_f32,
                )


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_warp_specialized_matches_its_twin_and_the_others(
    lib: ctypes.CDLL, rng: np.random.Generator, shape: tuple[int, int, int]
) -> None:
    """The producer / consumer kernel on the packed weight: the twin's values, and the
    bits of the cp.async kernels (the same instruction sequence per element)."""
    m, n, k = shape
    x, w = operands(rng, m, n, k)
    for out_f32 in (False, True):
        got = emulated_ws(lib, x, w, out_f32=out_f32)
        check_twin(got, x, w, out_f32=out_f32)
        assert np.array_equal(bits(got), bits(emulated(lib, WG2, x, w, out_f32=out_f32)))
        wide = emulated_ws(lib, x, w, out_f32=out_f32, wide=True)
        assert np.array_equal(bits(wide), bits(got))
        decode = emulated_ws(lib, x, w, out_f32=out_f32, decode=True)
        assert np.array_equal(bits(decode), bits(got))
        m64 = emulated_ws(lib, x, w, out_f32=out_f32, m64=True)
        assert np.array_equal(bits(m64), bits(got))
    shifted = emulated_ws(lib, x, w, out_f32=False, x_shift=1)  # the plain-store route
    assert np.array_equal(bits(shifted), bits(emulated_ws(lib, x, w, out_f32=False)))
    shifted = emulated_ws(lib, x, w, out_f32=False, x_shift=1, wide=True)
    assert np.array_equal(bits(shifted), bits(emulated_ws(lib, x, w, out_f32=False)))


@pytest.mark.parametrize(
    ("tile", "rows"),
    [("ws", 1), ("ws", 128), ("wide", 3), ("decode", 1), ("m64", 64), ("ws", 129), ("m64", 65)],
)
def test_weights_read_once_a_launch_go_under_l2_evict_first(
    lib: ctypes.CDLL, rng: np.random.Generator, tile: str, rows: int
) -> None:
    """With one m tile (M <= the tile's BM: a decode's rows) every weight byte is read by
    one CTA, once, and the producer's bulk copies bring it under L2's evict-first policy
    (bulk_copy_g2s_hinted: counted by the emulation); with more, a weight tile serves
    every m tile's CTA, and no copy carries the hint. Same values either way (a hint)."""
    lib.emu_evict_first_bytes.restype = ctypes.c_ulonglong
    lib.emu_evict_first_bytes()  # zeroed
    n, k = 256, 256
    x, w = operands(rng, rows, n, k)
    got = emulated_ws(lib, x, w, out_f32=False, **({tile: True} if tile != "ws" else {}))
    check_twin(got, x, w, out_f32=False)
    bm = {"ws": WS, "wide": WS_WIDE, "decode": WS_DECODE, "m64": WS_M64}[tile].block_m
    assert lib.emu_evict_first_bytes() == (n * k * 2 if rows <= bm else 0)


def test_warp_specialized_layouts_give_the_same_bits(
    lib: ctypes.CDLL, lib_interleave: ctypes.CDLL, rng: np.random.Generator
) -> None:
    """The no-swizzle stage layout (the kernel built with REPRISE_WS_SWIZZLE=0 on a weight
    packed without the swizzle) gives the swizzled kernel's bits, WS and WS_WIDE; a weight
    packed in the other layout than the kernel's does not (the layouts really differ)."""
    x, w = operands(rng, 70, 300, 192)
    want = emulated_ws(lib, x, w, out_f32=True)
    check_twin(want, x, w, out_f32=True)
    for wide in (False, True):
        got = emulated_ws(lib_interleave, x, w, out_f32=True, wide=wide, swizzle=False)
        assert np.array_equal(bits(got), bits(want)), wide
    mixed = emulated_ws(lib, x, w, out_f32=True, swizzle=False)
    assert not np.array_equal(bits(mixed), bits(want))


def test_warp_specialized_rows_do_not_depend_on_m(
    lib: ctypes.CDLL, rng: np.random.Generator
) -> None:
    x, w = operands(rng, 200, 300, 512)
    full = emulated_ws(lib, x, w, out_f32=True)
    for m, start in ((1, 0), (1, 199), (7, 100), (64, 3), (129, 41)):
        part = emulated_ws(lib, x[start : start + m], w, out_f32=True)
        assert np.array_equal(bits(part), bits(full[start : start + m])), (m, start)
        wide = emulated_ws(lib, x[start : start + m], w, out_f32=True, wide=True)
        assert np.array_equal(bits(wide), bits(full[start : start + m])), (m, start)
        decode = emulated_ws(lib, x[start : start + m], w, out_f32=True, decode=True)
        assert np.array_equal(bits(decode), bits(full[start : start + m])), (m, start)
        m64 = emulated_ws(lib, x[start : start + m], w, out_f32=True, m64=True)
        assert np.array_equal(bits(m64), bits(full[start : start + m])), (m, start)


def test_rows_past_m_padded_once_or_every_tile_give_the_same_bits(
    lib: ctypes.CDLL, lib_pad_every_tile: ctypes.CDLL, rng: np.random.Generator
) -> None:
    """The default (rows past M zeroed once, a consumer with no row idle) and the
    baseline build (zero-filled every k-tile, every consumer computing) give the same
    bits on every ws tile and route, at M where a consumer idles (1, 7, 64), where none
    does (65), and past one m tile (130: the second m tile's consumer 1 idles). K of
    12 k-tiles refills every ring slot, so the zeros written once must last; x off 16-byte
    alignment takes the plain-store route."""
    x, w = operands(rng, 130, 272, 768)
    for m in (1, 7, 64, 65, 130):
        xs = np.ascontiguousarray(x[:m])
        for route in (None, "ws_split", "ws_fold", "decode_split", "m64_split", "wide_fold",
                      "tall_fold"):  # fmt: skip
            if route in ("decode_split", "m64_split") and m > 64:
                continue
            plan = launch_plan(m, 272, 768, out_f32=True, packed=True, route=route)
            got = emulated_plan(lib, plan, xs, w, out_f32=True)
            want = emulated_plan(lib_pad_every_tile, plan, xs, w, out_f32=True)
            assert np.array_equal(bits(got), bits(want)), (m, route)
        for kwargs in ({}, {"decode": True}, {"m64": True}, {"wide": True}, {"x_shift": 1}):
            if (kwargs.get("decode") or kwargs.get("m64")) and m > 64:
                continue
            got = emulated_ws(lib, xs, w, out_f32=False, **kwargs)
            want = emulated_ws(lib_pad_every_tile, xs, w, out_f32=False, **kwargs)
            assert np.array_equal(bits(got), bits(want)), (m, kwargs)
        check_twin(got, xs, w, out_f32=False)


def test_prepare_weight_lays_out_the_stage_tiles(rng: np.random.Generator) -> None:
    """Element (n, k) at the place the kernel's stage layout reads it from, rows padded
    with zeros to a multiple of PACK_ROWS."""
    n, k = 300, 192
    w = rng.integers(0, 2**16, (n, k), dtype=np.uint16)
    packed = prepare_weight(w)
    assert isinstance(packed, PackedWeight) and packed.shape == (n, k)
    rows = -(-n // PACK_ROWS) * PACK_ROWS
    assert packed.data.shape == (rows * k,) and packed.data.dtype == np.uint16
    # what LlamaModel.num_bytes reads of every weight, padding included
    assert packed.nbytes == rows * k * 2 > w.nbytes
    assert packed.swizzled
    places = [(0, 0), (7, 8), (8, 7), (63, 63), (64, 64), (299, 191), (130, 77), (13, 20)]
    tiles = packed.data.reshape(rows // 64, k // 64, 64 * 64)
    for row, col in places:  # row r at 64 r, its chunk j at position j ^ (r % 8)
        r, j, e = row % 64, (col % 64) // 8, col % 8
        assert tiles[row // 64, col // 64, 64 * r + 8 * (j ^ (r % 8)) + e] == w[row, col]
    # every element once: the layout's inverse gives w back over zero rows
    unpacked = tiles.reshape(rows // 64, k // 64, 64, 8, 8)
    r = np.arange(64).reshape(64, 1)
    unpacked = unpacked[:, :, r, np.arange(8).reshape(1, 8) ^ (r % 8), :].transpose(0, 2, 1, 3, 4)
    assert np.array_equal(unpacked.reshape(rows, k)[:n], w)
    assert not unpacked.reshape(rows, k)[n:].any()
    plain = prepare_weight(w, swizzle=False)  # the no-swizzle core-matrix layout
    assert not plain.swizzled and plain.data.shape == packed.data.shape
    tiles = plain.data.reshape(rows // 64, k // 64, 64 * 64)
    for row, col in places:
        g, r8, j, e = (row % 64) // 8, row % 8, (col % 64) // 8, col % 8
        assert tiles[row // 64, col // 64, (64 * g + 8 * j + r8) * 8 + e] == w[row, col]
    unpacked = tiles.reshape(rows // 64, k // 64, 8, 8, 8, 8).transpose(0, 2, 4, 1, 3, 5)
    assert np.array_equal(unpacked.reshape(rows, k)[:n], w)
    with pytest.raises(ValueError, match="K a positive multiple of 64"):
        prepare_weight(w[:, :100].copy())


def test_traps_when_the_launch_does_not_match_its_tile(lib: ctypes.CDLL) -> None:
    """The kernel checks its thread count and dynamic shared memory against its tile; here,
    in a child process, since __trap aborts."""
    for config, threads, smem in ((WG1, WG1.num_threads, WG1.smem_bytes - 16),
                                  (WG2, WG1.num_threads, WG2.smem_bytes)):  # fmt: skip
        script = (
            "import ctypes, numpy as np\n"
            f"lib = ctypes.CDLL({lib._name!r})\n"
            "x = np.zeros(64, np.uint16); y = np.zeros(1, np.uint16)\n"
            "p = lambda a: a.ctypes.data_as(ctypes.c_void_p)\n"
            f"lib.run_gemm_sm90({config.kernel_name(False).encode()!r}, 1, 1, {threads}, {smem}, "
            "p(x), p(x), p(y), 1, 1, 64)\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
        )
        assert done.returncode != 0 and "__trap()" in done.stderr, (threads, smem, done.stderr)


# ---- the launcher, without a device ------------------------------------------------------


def test_launcher_refuses_what_the_kernel_cannot_take() -> None:
    """Checked before anything touches CuPy: NumPy arrays stand in for device arrays."""
    x, w = np.zeros((4, 128), np.uint16), np.zeros((8, 128), np.uint16)
    with pytest.raises(
        ValueError, match="K must be a positive multiple of 64 for gemm_sm90; got K = 48"
    ):
        gemm_sm90(np.zeros((4, 48), np.uint16), np.zeros((8, 48), np.uint16))
    with pytest.raises(ValueError, match="same K"):
        gemm_sm90(x, np.zeros((8, 64), np.uint16))
    with pytest.raises(ValueError, match="x must be a 2-d uint16 device array; got float32"):
        gemm_sm90(x.astype(np.float32), w)
    with pytest.raises(ValueError, match="w must be C-contiguous"):
        gemm_sm90(x, np.zeros((128, 8), np.uint16).T)
    with pytest.raises(ValueError, match="N must be at most 8388480"):
        gemm_sm90(x, _tall_weight())


def _tall_weight() -> np.ndarray:
    """A weight too tall for the grid, without allocating 2 GB: only the attributes the
    checks read."""

    class Tall:
        dtype = np.dtype(np.uint16)
        shape = (8388481, 128)

        class flags:  # the attribute name CuPy and NumPy use
            c_contiguous = True

    return Tall()  # type: ignore[return-value]


def test_supported_follows_the_dispatch_rule() -> None:
    """Compute capability 9.0 with K % 64 == 0 only, whatever M."""
    for m in (0, 1, 7, 64, 2048, 10**6):
        for arch in ("90", "sm_90", 90):
            assert supported(arch, m, 4096, 4096)
            assert supported(arch, m, 4096, 14336)
            assert not supported(arch, m, 4096, 4096 + 16)
        for arch in ("80", "89", "100", "sm_120", 86):
            assert not supported(arch, m, 4096, 4096)
        assert not supported("90", m, 0, 4096)
        assert not supported("90", m, MAX_N + 1, 4096)


MAX_N = 65535 * 128


def test_configs_mirror_the_source() -> None:
    """The numbers of gemm_sm90.cu's `Sm90Tile<BM, BN, STAGES>` instantiations."""
    source = (Path(__file__).parents[1] / "cuda" / "gemm_sm90.cu").read_text()
    for config, tile in ((WG1, "Wg1"), (WG2, "Wg2"), (WG2_WIDE, "Wg2Wide")):
        decl = f"using {tile} = Sm90Tile<{config.block_m}, {config.block_n}, {config.num_stages}>;"
        assert decl in source, decl
        assert config.smem_bytes <= 227 * 1024  # an H100's per-block opt-in limit
        for out_f32 in (False, True):
            assert f"\n{config.kernel_name(out_f32)}(" in source
    for config, tile in ((WS, "Ws"), (WS_WIDE, "WsWide"), (WS_DECODE, "WsDecode"),
                         (WS_TALL, "WsTall")):  # fmt: skip
        numbers = f"{config.block_m}, {config.block_n}, {config.num_stages}"
        assert f"using {tile} = Sm90WsTile<{numbers}>;" in source, tile
        assert config.smem_bytes <= 227 * 1024 and config.num_threads == 128 * (
            1 + config.block_m // 64
        )
        suffix = "_fold" if config is WS_TALL else ""  # the tall tile only folds
        for out_f32 in (False, True):
            assert f"\n{config.kernel_name(out_f32)}{suffix}(" in source
    assert 2 * (WS_DECODE.smem_bytes + 1024) <= 227 * 1024  # 2 CTAs an SM


@pytest.mark.parametrize("layer", sorted(LLAMA_8B))
def test_geometry_fills_an_h100_on_llama_8b(layer: str) -> None:
    """At M = 2,048 every 8B projection launches at least one full wave on 132 SMs and its
    grid covers the output exactly once; M = 512 fills at least 96 % of a wave."""
    n, k = LLAMA_8B[layer]
    assert supported("90", 2048, n, k)
    for m, least in ((2048, 1.0), (512, 0.96)):
        config = tile_config(m, n)
        gx, gy = grid(config, m, n)
        assert (gx - 1) * config.block_m < m <= gx * config.block_m
        assert (gy - 1) * config.block_n < n <= gy * config.block_n
        assert waves(config, m, n) >= least, (m, config.name, waves(config, m, n))
    assert tile_config(1, n) is WG1 and tile_config(64, n) is WG1


def test_the_launcher_launches_what_the_kernels_take(
    lib: ctypes.CDLL, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gemm_sm90 itself, its device calls replaced by the emulation: the grid, block,
    shared memory and arguments it passes run each kernel to the twin's values, for a
    plain and a packed weight, and the same bits from both."""
    from reprise.cuda import gemm_sm90_kernel as launcher

    launches: list[str] = []

    def fake_kernel(name: str, smem_bytes: int, device_id: int, swizzle: bool,
                    pad_once: bool, ablate: int = 0) -> Any:  # fmt: skip
        assert swizzle, "prepare_weight's default layout, which the emulation is built for"
        assert ablate == 0, "the kernel as it is: an ablation build is the benchmark's alone"
        assert pad_once, "the default build (PAD_ONCE), which the emulation is built for"

        def launch(
            grid_xy: tuple[int, int], block: tuple[int], args: tuple, *, shared_mem: int
        ) -> None:
            assert shared_mem == smem_bytes
            launches.append(name)
            if len(args) == 6:  # WHOLE
                x, w, y, m, n, k = args
                call = (
                    *grid_xy,
                    block[0],
                    shared_mem,
                    ptr(x),
                    ptr(w),
                    ptr(y),
                    int(m),
                    int(n),
                    int(k),
                )
                if name.startswith("gemm_sm90_ws_"):
                    tile = 1 if name.endswith("_wide") else 2 if name.endswith("_decode") else 0
                    rc = lib.run_gemm_sm90_ws(int("f32" in name), tile, *call)
                else:
                    rc = lib.run_gemm_sm90(name.encode(), *call)
            else:
                if len(args) == 9:  # PARTIAL: x, w, ws, y, counters, M, N, K, split_len
                    x, w, ws, y, counters, *dims = args
                    ws.view(np.uint8).fill(0xFF)
                elif len(args) == 8:  # the wide FOLD: x, w, totals, y, M, N, K, split_len
                    x, w, ws, y, *dims = args
                    ws.view(np.uint8).fill(0xFF)
                    counters = None
                else:  # FOLD: x, w, y, M, N, K, split_len
                    (x, w, y, *dims), ws, counters = args, None, None
                rc = lib.run_gemm_sm90_split(
                    name.encode(), *grid_xy, block[0], shared_mem, ptr(x), ptr(w),
                    None if ws is None else ptr(ws), ptr(y),
                    None if counters is None else ptr(counters), *map(int, dims),
                )  # fmt: skip
                if counters is not None:
                    assert not counters.any(), "the split route leaves its counters zero"
            assert rc == 0, rc

        return launch

    monkeypatch.setattr(launcher, "_kernel", fake_kernel)
    monkeypatch.setattr(launcher, "device_arch", lambda: "90")
    monkeypatch.setattr(launcher, "_num_sms", lambda: 132)
    monkeypatch.setattr(launcher, "_device_id", lambda: 0)
    monkeypatch.setattr(launcher, "stream_counters", lambda launches, size, device_id: COUNTERS)
    monkeypatch.setitem(sys.modules, "cupy", _NumpyAsCupy)
    monkeypatch.setattr(pdl, "active", lambda: "0")  # CuPy's launch (the fake kernel's call)
    # the cluster split launches through the driver (its own test below): PARTIAL here
    monkeypatch.setattr(launcher.gemm_sm90_plan, "CSPLIT_BY_DEFAULT", False)
    for m, sms in ((1, 132), (70, 132), (130, 132), (130, 2)):  # 2 SMs: the wide ws tile
        monkeypatch.setattr(launcher, "_num_sms", lambda sms=sms: sms)
        x, w = operands(rng, m, 200, 128)
        x_bits, w_bits = x.view(np.uint16), w.view(np.uint16)
        for out_f32 in (False, True):
            dtype = np.float32 if out_f32 else np.uint16
            plain = gemm_sm90(x_bits, w_bits, out_f32=out_f32, out=poisoned((m, 200), dtype))
            check_twin(plain.view(F32 if out_f32 else BF16), x, w, out_f32=out_f32)
            packed = gemm_sm90(
                x_bits, prepare_weight(w_bits), out_f32=out_f32, out=poisoned((m, 200), dtype)
            )
            assert np.array_equal(bits(packed), bits(plain))
    # M = 1: the decode tile (DECODE_TILE_BY_DEFAULT; WS's grid of 2 CTAs under a wave)
    tiles = (WG1, WG2, WS, WS_WIDE, WS_DECODE)
    names = {c.kernel_name(f) for c in tiles for f in (False, True)}
    assert set(launches) == names | {WG2_WIDE.kernel_name(f) for f in (False, True)}
    monkeypatch.setattr(launcher, "_num_sms", lambda: 132)
    # a weight that splits (S = 4): the PARTIAL routes at M <= BM, FOLD past it
    routes_run = [(WG1, "split"), (WG2, "fold"), (WS, "split"), (WS, "fold"), (WS_WIDE, "fold"),
                  (WS_DECODE, "split"), (WS_TALL, "fold")]  # fmt: skip
    launches.clear()
    for m, route in ((1, None), (70, None), (130, None), (130, "wide_fold"), (7, "decode_split"),
                     (200, "tall_fold")):  # fmt: skip
        x, w = operands(rng, m, 272, 1024)
        assert split_k(272, 1024) == 4
        x_bits, w_bits = x.view(np.uint16), w.view(np.uint16)
        for out_f32 in (False, True):
            dtype = np.float32 if out_f32 else np.uint16
            plain = gemm_sm90(x_bits, w_bits, out_f32=out_f32, out=poisoned((m, 272), dtype))
            check_twin(plain.view(F32 if out_f32 else BF16), x, w, out_f32=out_f32)
            packed = gemm_sm90(
                x_bits, prepare_weight(w_bits), out_f32=out_f32, out=poisoned((m, 272), dtype),
                route=route,
            )  # fmt: skip
            assert np.array_equal(bits(packed), bits(plain))
    assert set(launches) == {
        f"{c.kernel_name(f)}_{route}" for c, route in routes_run for f in (False, True)
    }
    monkeypatch.setattr(launcher, "device_arch", lambda: "80")
    with pytest.raises(
        ValueError, match=r"needs compute capability 9\.0 \(sm_90a\); this device is 80"
    ):
        gemm_sm90(x_bits, w_bits, out=poisoned((x_bits.shape[0], 272), np.uint16))


def test_the_backend_picks_the_hopper_kernel_per_weight_never_per_m(
    monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator
) -> None:
    """CupyBackend(gemm="wgmma"), and the default on sm_90, packs a weight the Hopper
    kernel takes when it loads, and its gemm then sends every M of that weight there; a
    weight it cannot take (K not a multiple of 64), another device, or gemm="mma" stays
    on gemm.cu. `kernel_choice` names the family the device gives its weights."""
    pytest.importorskip("cupy")
    from reprise.cuda import cupy_backend
    from reprise.cuda import gemm_sm90_kernel as launcher
    from reprise.cuda.gemm_sm90_kernel import PackedWeight

    calls: list[tuple[str, int]] = []
    monkeypatch.setattr(cupy_backend, "to_device", lambda a: a.view(np.uint16))
    monkeypatch.setattr(launcher, "gemm_sm90", lambda x, w, **kw: calls.append(("wgmma", len(x))))
    from reprise.cuda import gemm_kernel

    monkeypatch.setattr(gemm_kernel, "gemm", lambda x, w, **kw: calls.append(("mma", len(x))))
    _, w = operands(rng, 1, 200, 128)
    _, w_odd = operands(rng, 1, 200, 96)
    for arch, family, expect in (
        ("90", "wgmma", "wgmma"),
        ("80", "wgmma", "mma"),
        ("90", "mma", "mma"),
        ("90", None, "wgmma"),  # the default: WGMMA_BY_DEFAULT, on sm_90 only
        ("80", None, "mma"),
    ):
        monkeypatch.setattr(launcher, "device_arch", lambda arch=arch: arch)
        backend = cupy_backend.CupyBackend(gemm=family)
        assert backend.kernel_choice == f"tensor-cores/{expect}"
        weight, odd = backend.linear_weight(w), backend.linear_weight(w_odd)
        assert isinstance(weight, PackedWeight) == (expect == "wgmma")
        assert not isinstance(odd, PackedWeight)
        calls.clear()
        for m in (1, 7, 300):
            backend.gemm(np.zeros((m, 128), np.uint16), weight)
            backend.gemm(np.zeros((m, 96), np.uint16), odd)
        assert calls == [
            (expect, 1),
            ("mma", 1),
            (expect, 7),
            ("mma", 7),
            (expect, 300),
            ("mma", 300),
        ]
    with pytest.raises(ValueError, match="gemm must be one of mma, wgmma; got 'cublas'"):
        cupy_backend.CupyBackend(gemm="cublas")



def test_the_backend_runs_the_mlp_in_the_gated_epilogue_where_the_flag_and_device_allow(
    monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator
) -> None:
    """With GATED_BY_DEFAULT on, a fused gate/up weight the Hopper kernel takes loads packed
    with its rows interleaved, and `swiglu` is one gated launch; off, on another device, on
    gemm="mma" or with an odd row count, it loads as any weight and `swiglu` is the
    product then silu_mul (through `gemm`, which the cuBLAS benchmark's subclass replaces)."""
    pytest.importorskip("cupy")
    from reprise.cuda import cupy_backend, gemm_kernel, gemm_sm90_plan
    from reprise.cuda import gemm_sm90_kernel as launcher

    calls: list[tuple[str, bool]] = []
    monkeypatch.setattr(cupy_backend, "to_device", lambda a: a.view(np.uint16))
    monkeypatch.setattr(launcher, "gemm_sm90", lambda x, w, **kw: calls.append(("wgmma", kw.get("gated", False))) or "y")
    monkeypatch.setattr(gemm_kernel, "gemm", lambda x, w, **kw: calls.append(("mma", False)) or "y")
    monkeypatch.setattr(cupy_backend.CupyBackend, "silu_mul",
                        staticmethod(lambda h: calls.append(("silu_mul", h == "y")) or "a"))  # fmt: skip
    _, w = operands(rng, 1, 2 * 136, 128)
    _, odd = operands(rng, 1, 2 * 136 + 1, 128)
    for flag, arch, family, weight, gated in (
        (True, "90", None, w, True),
        (True, "90", "wgmma", w, True),
        (True, "90", "mma", w, False),
        (True, "80", None, w, False),
        (True, "90", None, odd, False),
        (False, "90", None, w, False),
    ):
        monkeypatch.setattr(gemm_sm90_plan, "GATED_BY_DEFAULT", flag)
        monkeypatch.setattr(launcher, "device_arch", lambda arch=arch: arch)
        backend = cupy_backend.CupyBackend(gemm=family)
        loaded = backend.gate_up_weight(weight)
        packed = isinstance(loaded, PackedWeight)
        assert (packed and loaded.gated) == gated, (flag, arch, family)
        if gated:
            want = prepare_weight(np.ascontiguousarray(interleaved(weight.view(np.uint16))))
            assert np.array_equal(loaded.data, want.data)
        calls.clear()
        assert backend.swiglu(np.zeros((3, 128), np.uint16), loaded) == ("y" if gated else "a")
        kind = "wgmma" if packed else "mma"
        assert calls == ([("wgmma", True)] if gated else [(kind, False), ("silu_mul", True)])


def test_the_backend_sends_a_packed_projection_and_its_epilogue_to_the_hopper_launcher(
    monkeypatch: pytest.MonkeyPatch, rng: np.random.Generator
) -> None:
    """CupyBackend.gemm_add_rmsnorm and gemm_rope_kv_write: on a plain packed weight, the
    Hopper launcher's gemm_sm90_add_rmsnorm / gemm_sm90_rope_kv_write (which take their
    row epilogue where they may); on a plain weight (gemm.cu, or the cuBLAS benchmark's
    subclass) or a gated one, the product through `gemm`, then the op's kernel."""
    pytest.importorskip("cupy")
    from reprise.cuda import cupy_backend
    from reprise.cuda import gemm_sm90_kernel as launcher

    calls: list[str] = []
    backend_cls = cupy_backend.CupyBackend
    monkeypatch.setattr(launcher, "gemm_sm90_add_rmsnorm",
                        lambda x, w, r, g, eps: calls.append("fused norm") or ("s", "n"))  # fmt: skip
    monkeypatch.setattr(launcher, "gemm_sm90_rope_kv_write",
                        lambda x, w, *args: calls.append(f"fused rope {len(args)}") or "q")  # fmt: skip
    monkeypatch.setattr(backend_cls, "gemm",
                        staticmethod(lambda x, w, **kw: calls.append("gemm") or np.zeros((1, 256))))  # fmt: skip
    monkeypatch.setattr(backend_cls, "add_rmsnorm",
                        staticmethod(lambda r, d, g, eps: calls.append(f"add_rmsnorm {d.shape}") or ("S", "N")))  # fmt: skip
    monkeypatch.setattr(backend_cls, "rope_kv_write",
                        staticmethod(lambda qkv, *args: calls.append(f"rope_kv_write {qkv.shape}") or "Q"))  # fmt: skip
    _, w = operands(rng, 1, 2 * 136, 128)
    bits_w = np.ascontiguousarray(w).view(np.uint16)
    backend = backend_cls.__new__(backend_cls)
    x, residual, norm = np.zeros((1, 128), np.uint16), np.zeros((1, 272), F32), np.zeros(272, np.uint16)
    cache = np.zeros((2, 1, 2, 1, 16, 64), np.uint16)  # head_dim 64: the product's 256 as 4 heads
    rope = (np.zeros(1, np.int32), None, None, cache, 0, np.zeros(1, np.int64), 2)
    for weight, fused in ((prepare_weight(bits_w), True), (bits_w, False),
                          (prepare_weight(bits_w, gated=True), False)):  # fmt: skip
        calls.clear()
        out = backend.gemm_add_rmsnorm(x, weight, residual, norm, 1e-5)
        assert out == (("s", "n") if fused else ("S", "N"))
        assert calls == (["fused norm"] if fused else ["gemm", "add_rmsnorm (1, 256)"])
        calls.clear()
        assert backend.gemm_rope_kv_write(x, weight, *rope) == ("q" if fused else "Q")
        assert calls == (["fused rope 7"] if fused else ["gemm", "rope_kv_write (1, 4, 64)"])

# ---- split-K ---------------------------------------------------------------------------

COUNTERS = np.zeros(65536, np.uint32)


class _NumpyAsCupy:
    """What gemm_sm90 asks of CuPy on the split route, from NumPy (the emulation's arrays)."""

    empty = staticmethod(np.empty)
    empty_like = staticmethod(np.empty_like)

    class cuda:  # CuPy's name
        @staticmethod
        def get_current_stream() -> Any:
            class Stream:
                ptr = 0

            return Stream()


# (M, N, K) that split: S = split_k(N, K) > 1 with these small N (a short last split in
# the second: K = 640 in splits of 256).
SPLIT_SHAPES = [(300, 272, 1024), (300, 200, 640)]


def packed_route(route: str) -> bool:
    """Whether a SPLIT_ROUTES route runs a warp-specialized kernel (on a packed weight)."""
    return isinstance(SPLIT_ROUTES[route][0], Sm90WsConfig)


def emulated_plan(
    lib: ctypes.CDLL, plan: Sm90Launch, x: np.ndarray, w: np.ndarray, *, out_f32: bool,
    order: np.ndarray | None = None, x_shift: int = 0,
) -> np.ndarray:  # fmt: skip
    """`plan`'s launch on the emulation, as gemm_sm90 makes it: the output and the fp32
    workspace poisoned (NaN), the counters zero and checked zero after; `order` (a
    permutation of the grid's CTAs) the order the CTAs run and finish in; `x_shift`
    elements move x off 16-byte alignment (the plain-load route)."""
    (m, k), n = x.shape, w.shape[0]
    x_buf = np.empty(m * k + x_shift, np.uint16)
    x_buf[x_shift:] = np.ascontiguousarray(x).view(np.uint16).reshape(-1)
    w_bits = np.ascontiguousarray(w).view(np.uint16)
    weight = prepare_weight(w_bits).data if "_ws_" in plan.kernel else w_bits
    dtype = np.float32 if out_f32 else np.uint16
    y_buf = poisoned((m * n + GUARD,), dtype)
    ws = poisoned((plan.splits * m * n + GUARD,), np.float32)
    counters = np.zeros(plan.grid[0] * plan.grid[1] + GUARD, np.uint32)
    if order is not None:
        order = np.ascontiguousarray(order, dtype=np.uint32)
        assert sorted(order) == list(range(plan.grid[0] * plan.grid[1]))
        lib.set_cta_order(ptr(order))
    try:
        rc = lib.run_gemm_sm90_split(
            plan.kernel.encode(), *plan.grid, plan.threads, plan.smem_bytes,
            ptr(x_buf[x_shift:]), ptr(weight), ptr(ws), ptr(y_buf),
            ptr(counters), m, n, k, plan.split_len,
        )  # fmt: skip
    finally:
        lib.set_cta_order(None)
    assert rc == 0, (plan.kernel, rc)
    assert not counters.any(), "every tile counter left zero for the next launch"
    assert np.array_equal(bits(y_buf[m * n :]), bits(poisoned((GUARD,), dtype)))
    if plan.workspace:  # nothing past the [S, M, N] workspace
        assert np.array_equal(bits(ws[-GUARD:]), bits(poisoned((GUARD,), np.float32)))
    if plan.totals:  # the wide FOLD's running totals: [M, N], nothing past them
        assert np.array_equal(bits(ws[m * n :]), bits(poisoned((ws.size - m * n,), np.float32)))
    return y_buf[: m * n].reshape(m, n).view(F32 if out_f32 else BF16)


def fold_reference(lib: ctypes.CDLL, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The split rule computed another way: the unsplit kernel (WHOLE, fp32 out) on each
    split's K range gives that split's partial, and gemm.fold_partials (NumPy) folds
    them: a split route's fp32 output must equal it bit for bit."""
    n, k = w.shape
    bounds = split_bounds(k, split_length(k, split_k(n, k)))
    assert len(bounds) == split_k(n, k) > 1
    partials = [
        emulated(lib, WG2, np.ascontiguousarray(x[:, a:b]), np.ascontiguousarray(w[:, a:b]),
                 out_f32=True)
        for a, b in bounds
    ]  # fmt: skip
    return fold_partials(np.stack(partials).view(F32))


@pytest.mark.parametrize("shape", SPLIT_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_split_routes_fold_the_partials_of_fixed_k_ranges(
    lib: ctypes.CDLL, rng: np.random.Generator, shape: tuple[int, int, int]
) -> None:
    """Every split route, at M = 1, 7, 64 and 300 (rows at several places in their tiles):
    fp32 out bit-equals the fold of the unsplit kernel's partials, BF16 out its one
    rounding, and both the twin's values within rounding. So no route depends on M, on
    the row's position or on the configuration."""
    m_max, n, k = shape
    x, w = operands(rng, m_max, n, k)
    want = fold_reference(lib, x, w)
    unsplit = emulated(lib, WG2, x, w, out_f32=True)  # a fold is not the one long chain
    assert not np.array_equal(bits(want), bits(unsplit))
    for m, start in ((1, 0), (1, 299), (7, 100), (64, 3), (300, 0)):
        rows = slice(start, start + m)
        xs = np.ascontiguousarray(x[rows])
        for route in SPLIT_ROUTES:
            plan = launch_plan(m, n, k, out_f32=True, packed=packed_route(route), route=route)
            got = emulated_plan(lib, plan, xs, w, out_f32=True)
            assert np.array_equal(bits(got), bits(want[rows])), (route, m, start)
            plan = launch_plan(m, n, k, out_f32=False, packed=packed_route(route), route=route)
            got16 = emulated_plan(lib, plan, xs, w, out_f32=False)
            assert np.array_equal(bits(got16), bits(to_bf16(want[rows]))), (route, m, start)
        check_twin(got, xs, w, out_f32=True)
        check_twin(got16, xs, w, out_f32=False)


@pytest.mark.parametrize("ablate", [1, 2], ids=["notail", "nomma"])
def test_the_ablation_builds_leave_out_what_their_columns_say(
    tmp_path_factory: pytest.TempPathFactory, lib: ctypes.CDLL, rng: np.random.Generator,
    ablate: int,
) -> None:  # fmt: skip
    """bench_gemm_sm90's timing-only builds (REPRISE_GEMM_ABLATE, gemm_sm90_kernel.ABLATE):
    1 leaves a split weight's output at M = 7 unwritten on the PARTIAL routes (the
    partials stored, no fold: every element still poisoned), 2 writes zeros everywhere on
    the PARTIAL and FOLD routes (no MMA ran, every stage still went through the ring: the
    launch ends, nothing left in flight); the default build writes the fold reference."""
    built = build_driver(tmp_path_factory, f"-DREPRISE_GEMM_ABLATE={ablate}")
    x, w = operands(rng, 300, 272, 1024)
    want = fold_reference(lib, x, w)
    cases = [(7, "ws_split"), (7, "decode_split"), (7, "m64_split")]
    if ablate == 2:
        cases += [(300, "ws_fold"), (300, "tall_fold")]
    for m, route in cases:
        xs = np.ascontiguousarray(x[:m])
        plan = launch_plan(m, 272, 1024, out_f32=True, packed=True, route=route)
        got = emulated_plan(built, plan, xs, w, out_f32=True)
        if ablate == 1:
            assert np.array_equal(bits(got), bits(poisoned((m, 272), F32))), route
        else:
            assert np.array_equal(bits(got), bits(np.zeros((m, 272), F32))), route
        default = emulated_plan(lib, plan, xs, w, out_f32=True)
        assert np.array_equal(bits(default), bits(want[:m])), route


def test_split_rows_do_not_depend_on_the_order_ctas_finish(
    lib: ctypes.CDLL, rng: np.random.Generator
) -> None:
    """The PARTIAL routes' last CTA of a tile folds in split order whichever CTA it is:
    launch order, backwards and shuffled orders give the same bits, and so does one warp
    at a time running ahead of the rest (the fold's flag word and the drained ring)."""
    m, n, k = 7, 272, 1024
    x, w = operands(rng, m, n, k)
    for route in ("wg1_split", "ws_split", "decode_split", "m64_split"):
        plan = launch_plan(m, n, k, out_f32=True, packed=packed_route(route), route=route)
        count = plan.grid[0] * plan.grid[1]
        first = emulated_plan(lib, plan, x, w, out_f32=True)
        for order in (np.arange(count)[::-1], rng.permutation(count), rng.permutation(count)):
            got = emulated_plan(lib, plan, x, w, out_f32=True, order=order)
            assert np.array_equal(bits(got), bits(first)), route
        for schedule in (1, 2):
            lib.set_warp_major(schedule)
            try:
                got = emulated_plan(lib, plan, x, w, out_f32=True)
            finally:
                lib.set_warp_major(0)
            assert np.array_equal(bits(got), bits(first)), (route, schedule)


def test_the_tall_fold_keeps_its_bits_however_its_warps_take_turns(
    lib: ctypes.CDLL, rng: np.random.Generator
) -> None:
    """The tall FOLD's ring (one producer, three consumers counted on each stage's empty
    barrier; the third idle in the last m tile at M = 300) under a warp at a time, first
    to last and last to first (a warp running ahead of the others as a GPU may), and its
    CTAs in reverse: the fold reference's bits every time, BF16 and fp32."""
    m, n, k = 300, 272, 1024
    x, w = operands(rng, m, n, k)
    want = fold_reference(lib, x, w)
    for out_f32 in (True, False):
        plan = launch_plan(m, n, k, out_f32=out_f32, packed=True, route="tall_fold")
        expected = want if out_f32 else to_bf16(want)
        count = plan.grid[0] * plan.grid[1]
        for schedule in (0, 1, 2):
            lib.set_warp_major(schedule)
            try:
                got = emulated_plan(lib, plan, x, w, out_f32=out_f32)
                backwards = emulated_plan(lib, plan, x, w, out_f32=out_f32,
                                          order=np.arange(count)[::-1])  # fmt: skip
            finally:
                lib.set_warp_major(0)
            assert np.array_equal(bits(got), bits(expected)), (out_f32, schedule)
            assert np.array_equal(bits(backwards), bits(expected)), (out_f32, schedule)


def test_split_routes_take_unaligned_operands_and_odd_slabs(
    lib: ctypes.CDLL, rng: np.random.Generator
) -> None:
    """x off 16-byte alignment (plain loads) and an odd M * N (every other workspace slab
    off 8-byte alignment: scalar partial stores): the same bits as the fold reference."""
    m, n, k = 7, 201, 640
    assert split_k(n, k) > 1 and (m * n) % 2 == 1
    x, w = operands(rng, m, n, k)
    want = fold_reference(lib, x, w)
    for route in SPLIT_ROUTES:
        plan = launch_plan(m, n, k, out_f32=True, packed=packed_route(route), route=route)
        for x_shift in (0, 1):
            got = emulated_plan(lib, plan, x, w, out_f32=True, x_shift=x_shift)
            assert np.array_equal(bits(got), bits(want)), (route, x_shift)


@pytest.mark.usefixtures("ws_decodes")
def test_launch_plan_routes_by_weight_shape_then_m() -> None:
    """S = 1: WHOLE on the tile config (or the warp-specialized kernel). S > 1: PARTIAL up
    to the tile's rows, FOLD past them: never the wide cp.async tile (no FOLD registers),
    the wide ws tile where its grid fills the device (its totals in a workspace)."""
    assert split_k(28672, 4096) == 1
    whole = launch_plan(300, 28672, 4096, out_f32=False, packed=False)
    assert (whole.splits, whole.split_len, whole.workspace) == (1, 0, False)
    assert whole.kernel == tile_config(300, 28672).kernel_name(False)
    assert launch_plan(1, 28672, 4096, out_f32=True, packed=True).kernel == "gemm_sm90_ws_f32"
    s = split_k(4096, 4096)
    assert s > 1
    for m, plain, packed in ((1, "wg1_split", "ws_split"), (64, "wg1_split", "ws_split"),
                             (65, "wg2_fold", "ws_split"), (128, "wg2_fold", "ws_split"),
                             (129, "wg2_fold", "ws_fold"), (4096, "wg2_fold", "ws_fold")):  # fmt: skip
        for is_packed, route in ((False, plain), (True, packed)):
            plan = launch_plan(m, 4096, 4096, out_f32=False, packed=is_packed)
            config, kind = SPLIT_ROUTES[route]
            assert plan.kernel == f"{config.kernel_name(False)}_{kind}", (m, is_packed)
            assert plan.splits == s and plan.split_len == split_length(4096, s)
            assert plan.split_len % 64 == 0 and plan.workspace == (kind == "split")
            assert plan.totals == (route == "wide_fold")
            gx, gy = grid(config, m, 4096)
            assert plan.grid == ((gx * s if kind == "split" else gx), gy)
    wide = launch_plan(4096, 4096, 4096, out_f32=False, packed=True, route="wide_fold")
    assert (wide.kernel, wide.totals, wide.workspace) == (
        "gemm_sm90_ws_bf16_wide_fold",
        True,
        False,
    )
    assert wide.grid == grid(WS_WIDE, 4096, 4096) and wide.split_len == split_length(4096, s)
    with pytest.raises(ValueError, match="route must be one of wg1_split, wg2_fold"):
        launch_plan(1, 4096, 4096, out_f32=False, packed=False, route="wide_split")
    with pytest.raises(ValueError, match="route decode_split needs a packed weight"):
        launch_plan(1, 4096, 4096, out_f32=False, packed=False, route="decode_split")
    with pytest.raises(ValueError, match="route wide_fold needs a packed weight"):
        launch_plan(1, 4096, 4096, out_f32=False, packed=False, route="wide_fold")
    with pytest.raises(ValueError, match="route ws_fold needs a packed weight"):
        launch_plan(1, 4096, 4096, out_f32=False, packed=False, route="ws_fold")
    with pytest.raises(ValueError, match="splits must be a count that split_length cuts K = 4096"):
        launch_plan(1, 4096, 4096, out_f32=False, packed=False, splits=0)
    forced = launch_plan(1, 4096, 4096, out_f32=False, packed=True, splits=1)
    assert (forced.kernel, forced.splits, forced.workspace) == ("gemm_sm90_ws_bf16", 1, False)


@pytest.mark.usefixtures("ws_decodes")
def test_the_tall_fold_takes_large_folds_where_it_reads_less(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """TALL_FOLD_BY_DEFAULT off: WS's FOLD past one m tile at every M. On: the tall tile
    where `l2_cost` is lower (Llama-3.1-8B's split projections at M = 2,048 and 4,096,
    not at 512 or 1,024, where both take as many rounds), never at M <= 128 (PARTIAL) nor
    on an unsplit weight; its launch has 512 threads, its tile's grid and shared memory."""
    shapes = {"qkv": (6144, 4096), "o": (4096, 4096), "down": (4096, 14336)}
    for n, k in shapes.values():
        assert launch_plan(4096, n, k, out_f32=False, packed=True).kernel == "gemm_sm90_ws_bf16_fold"
    from reprise.cuda import gemm_sm90_plan as geometry

    monkeypatch.setattr(geometry, "TALL_FOLD_BY_DEFAULT", True)
    for name, (n, k) in shapes.items():
        s = split_k(n, k)
        assert s > 1, name
        for m, tall in ((1, False), (128, False), (129, False), (512, False), (1024, False),
                        (2048, True), (4096, True)):  # fmt: skip
            plan = launch_plan(m, n, k, out_f32=False, packed=True, num_sms=132)
            assert ("_tall_fold" in plan.kernel) == tall, (name, m, plan.kernel)
            if tall:
                assert plan.kernel == "gemm_sm90_ws_bf16_tall_fold"
                assert (plan.threads, plan.smem_bytes) == (512, WS_TALL.smem_bytes)
                assert plan.grid == grid(WS_TALL, m, n) and plan.split_len == split_length(k, s)
                assert not plan.workspace and not plan.totals and plan.cluster == 1
        gated = launch_plan(2048, n, k, out_f32=False, packed=True, gated=True, num_sms=132)
        assert gated.kernel == "gemm_sm90_ws_gated_tall_fold"
    # the model's figures for qkv at 2,048 rows, counted by hand: 11 x 48 tall CTAs are 4
    # rounds of 320 rows' bytes, 16 x 48 WS CTAs 6 rounds of 256; o: 3 x 320 against 4 x 256
    assert (l2_cost(WS_TALL, 2048, 6144, 132), l2_cost(WS, 2048, 6144, 132)) == (4 * 320, 6 * 256)
    assert (l2_cost(WS_TALL, 2048, 4096, 132), l2_cost(WS, 2048, 4096, 132)) == (3 * 320, 4 * 256)
    assert split_k(28672, 4096) == 1  # unsplit: WHOLE on the wide tile, whatever the flag
    assert launch_plan(2048, 28672, 4096, out_f32=False, packed=True).kernel == "gemm_sm90_ws_bf16_wide"
    assert WS_TALL.num_threads == 512 and WS_TALL.smem_bytes + 1024 <= 227 * 1024


@pytest.mark.usefixtures("ws_decodes")
def test_the_decode_tile_takes_decodes_whose_grid_is_under_a_wave(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With DECODE_TILE_BY_DEFAULT, M <= 64 runs WS_DECODE where WS's grid (S CTAs a tile)
    is under a wave: PARTIAL for Llama-3.1-8B's qkv, o and down (twice the CTAs: 192, 256,
    256, which hold 2 an SM: one round on 132 SMs), WHOLE for an unsplit weight that
    small; gate_up and lm_head keep WS (a wave or more), M > 64 keeps WS. Without the
    setting nothing changes."""
    from reprise.cuda import gemm_sm90_plan as geometry

    plans = {
        name: launch_plan(1, n, k, out_f32=False, packed=True) for name, (n, k) in LLAMA_8B.items()
    }
    assert not any("_decode" in plan.kernel for plan in plans.values())
    monkeypatch.setattr(geometry, "DECODE_TILE_BY_DEFAULT", True)
    for name, (n, k) in LLAMA_8B.items():
        plan = launch_plan(1, n, k, out_f32=False, packed=True)
        small = name in ("qkv", "o", "down")
        assert plan.kernel.endswith("_decode_split") == small, (name, plan.kernel)
        if small:
            ctas, before = plan.grid[0] * plan.grid[1], plans[name].grid[0] * plans[name].grid[1]
            assert plan.grid == (split_k(n, k), -(-n // 64)) and plan.threads == 256
            assert ctas == 2 * before and before < 132 and ctas <= 2 * 132, (name, ctas)
        assert "_decode" not in launch_plan(65, n, k, out_f32=False, packed=True).kernel
    head = launch_plan(64, *LM_HEAD_8B, out_f32=True, packed=True)
    assert head.kernel == "gemm_sm90_ws_f32"
    small = launch_plan(7, 2048, 128, out_f32=False, packed=True)  # S = 1, 16 CTAs of WS
    assert split_k(2048, 128) == 1 and small.kernel == "gemm_sm90_ws_bf16_decode"
    assert small.grid == (1, 32) and small.splits == 1
    assert small.smem_bytes == WS_DECODE.smem_bytes == 4 * (64 + 128) * 64 * 2 + 64


@pytest.mark.usefixtures("ws_decodes")
def test_the_m64_tile_takes_the_other_decodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """With M64_TILE_BY_DEFAULT, M <= 64 runs WS_M64 wherever the decode tile does not:
    WHOLE for Llama-3.1-8B's gate_up and lm_head (their WS grids pass a wave: 224 and 1,002
    CTAs, 2 an SM on this tile: gate_up's in one round on 132 SMs), PARTIAL for qkv, o and
    down unless DECODE_TILE_BY_DEFAULT gives them the decode tile; the same grid as WS
    (the 128 columns a CTA), half its threads; M > 64 keeps WS. Without the setting
    nothing changes."""
    from reprise.cuda import gemm_sm90_plan as geometry

    plans = {name: launch_plan(1, n, k, out_f32=False, packed=True)
             for name, (n, k) in {**LLAMA_8B, "lm_head": LM_HEAD_8B}.items()}  # fmt: skip
    assert not any("_m64" in plan.kernel for plan in plans.values())
    monkeypatch.setattr(geometry, "M64_TILE_BY_DEFAULT", True)
    for decode in (False, True):
        monkeypatch.setattr(geometry, "DECODE_TILE_BY_DEFAULT", decode)
        for name, (n, k) in {**LLAMA_8B, "lm_head": LM_HEAD_8B}.items():
            out_f32 = name == "lm_head"
            split = split_k(n, k) > 1
            for m in (1, 64):
                plan = launch_plan(m, n, k, out_f32=out_f32, packed=True)
                if decode and name in ("qkv", "o", "down"):
                    assert plan.kernel.endswith("_decode_split"), (name, plan.kernel)
                    continue
                want = WS_M64.kernel_name(out_f32) + ("_split" if split else "")
                assert plan.kernel == want, (name, m, plan.kernel)
                assert plan.grid == plans[name].grid and plan.threads == 256
                assert plan.smem_bytes == WS_M64.smem_bytes == 4 * (64 + 128) * 64 * 2 + 64
            assert "_m64" not in launch_plan(65, n, k, out_f32=out_f32, packed=True).kernel
    gate_up = plans["gate_up"].grid[0] * plans["gate_up"].grid[1]
    assert 132 < gate_up <= 2 * 132  # one round at 2 CTAs an SM, two at one


def test_split_routes_trap_on_a_split_length_off_the_k_tile(lib: ctypes.CDLL) -> None:
    """split_len must be a positive multiple of BK = 64 (the launcher's are multiples of
    128): a kernel passed another traps rather than mis-split K; in a child process."""
    for name, threads, smem in (("gemm_sm90_bf16_wg2_fold", WG2.num_threads, WG2.smem_bytes),
                                ("gemm_sm90_ws_bf16_split", WS.num_threads, WS.smem_bytes)):  # fmt: skip
        script = (
            "import ctypes, numpy as np\n"
            f"lib = ctypes.CDLL({lib._name!r})\n"
            "x = np.zeros(1 << 16, np.uint16); f = np.zeros(64, np.float32)\n"
            "c = np.zeros(4, np.uint32); p = lambda a: a.ctypes.data_as(ctypes.c_void_p)\n"
            f"lib.run_gemm_sm90_split({name.encode()!r}, 1, 1, {threads}, {smem}, "
            "p(x), p(x), p(f), p(f), p(c), 1, 1, 128, 96)\n"
        )
        done = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
        )
        assert done.returncode != 0 and "__trap()" in done.stderr, (name, done.stderr)


@pytest.mark.usefixtures("ws_decodes")
@pytest.mark.parametrize("layer", [*sorted(LLAMA_8B), "lm_head"])
def test_decode_grid_keeps_most_of_an_h100_busy_on_llama_8b(layer: str) -> None:
    """At M = 1 every 8B projection's launch, plain or packed, keeps more than half of an
    H100's 132 SMs busy (this kernel's CTA takes a whole SM), and S comes from
    gemm_kernel.split_k as gemm.cu's does (a count that fills one wave of gemm.cu's
    skinny grid: 64-wide tiles, two CTAs an SM)."""
    n, k = LM_HEAD_8B if layer == "lm_head" else LLAMA_8B[layer]
    for packed in (False, True):
        plan = launch_plan(1, n, k, out_f32=layer == "lm_head", packed=packed)
        assert plan.splits == split_k(n, k)
        ctas = plan.grid[0] * plan.grid[1]
        assert ctas == -(-n // 128) * plan.splits
        assert decode_waves(n, k, packed=packed) == ctas / 132 > 0.5, (layer, packed, ctas)
        if plan.splits > 1:  # the splits cover K exactly, in k-tiles of 64
            bounds = split_bounds(k, plan.split_len)
            assert len(bounds) == plan.splits and bounds[-1][1] == k
            assert all(a % 64 == 0 and b % 64 == 0 for a, b in bounds)


def test_fold_partials_adds_in_ascending_split_order() -> None:
    """The twin of the fold: ((+0 + P_0) + P_1) + P_2 in fp32, not any other grouping."""
    big, tiny = np.float32(2.0**24), np.float32(1.0)
    partials = np.array([[big], [tiny], [tiny]], dtype=np.float32)
    assert fold_partials(partials)[0] == big  # (2^24 + 1) + 1 rounds back twice
    assert fold_partials(partials[::-1].copy())[0] == big + 2  # 1 + 1 first
    negative_zero = np.array([[-0.0], [-0.0]], dtype=np.float32)
    assert np.signbit(fold_partials(negative_zero)[0]) == np.False_  # starts from +0
    assert split_bounds(640, 256) == [(0, 256), (256, 512), (512, 640)]


def test_gemm_family_decides_by_device_and_weight_shape_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The one dispatch decision: the requested family where `supported` takes the weight,
    mma.sync otherwise; the default follows WGMMA_BY_DEFAULT (off until measured)."""
    from reprise.cuda import gemm_sm90_kernel as launcher

    assert launcher.gemm_family("90", 4096, 4096, "wgmma") == "wgmma"
    assert launcher.gemm_family("90", 4096, 4096 + 16, "wgmma") == "mma"  # K % 64
    assert launcher.gemm_family("80", 4096, 4096, "wgmma") == "mma"
    assert launcher.gemm_family("90", 4096, 4096, "mma") == "mma"
    assert launcher.gemm_family("90", 4096, 4096) == (
        "wgmma" if launcher.WGMMA_BY_DEFAULT else "mma"
    )
    monkeypatch.setattr(launcher, "WGMMA_BY_DEFAULT", True)
    assert launcher.gemm_family("90", 4096, 4096) == "wgmma"
    assert launcher.gemm_family("89", 4096, 4096) == "mma"
    with pytest.raises(ValueError, match="gemm must be one of mma, wgmma; got 'cublas'"):
        launcher.gemm_family("90", 4096, 4096, "cublas")


# --- the gated epilogue (SwiGLU): silu(gate) * up of the fused gate/up product ------------


def interleaved(w: np.ndarray) -> np.ndarray:
    """A fused [2I, K] gate/up weight's rows as the gated weight orders them: gate j, up j."""
    half = w.shape[0] // 2
    return np.stack([w[:half], w[half:]], axis=1).reshape(w.shape)


def emulated_gated(lib: ctypes.CDLL, plan: Sm90Launch, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """A gated launch on the emulation: the weight packed with `gated`, the [M, N / 2]
    output and the fp32 workspace poisoned, counters zero and checked zero after."""
    (m, k), n = x.shape, w.shape[0]
    packed = prepare_weight(np.ascontiguousarray(w).view(np.uint16), gated=True)
    assert packed.gated
    y_buf = poisoned((m * (n // 2) + GUARD,), np.uint16)
    ws = poisoned((plan.splits * m * n + GUARD,), np.float32)
    counters = np.zeros(plan.grid[0] * plan.grid[1] + GUARD, np.uint32)
    rc = lib.run_gemm_sm90_split(
        plan.kernel.encode(), *plan.grid, plan.threads, plan.smem_bytes,
        ptr(np.ascontiguousarray(x).view(np.uint16)), ptr(packed.data), ptr(ws), ptr(y_buf),
        ptr(counters), m, n, k, plan.split_len,
    )  # fmt: skip
    assert rc == 0, (plan.kernel, rc)
    assert not counters.any(), "every tile counter left zero for the next launch"
    assert np.array_equal(bits(y_buf[m * (n // 2) :]), bits(poisoned((GUARD,), np.uint16)))
    return y_buf[: m * (n // 2)].reshape(m, n // 2).view(BF16)


def whole_plan(config: Sm90WsConfig, m: int, n: int, *, gated: bool) -> Sm90Launch:
    """A WHOLE launch on a given ws tile (launch_plan picks one by M and N)."""
    name = config.kernel_name(False, gated) if gated else config.kernel_name(False)
    return Sm90Launch(name, grid(config, m, n), config.num_threads, config.smem_bytes, 1, 0,
                      False, gated=gated)  # fmt: skip


def test_the_gated_weight_interleaves_gate_and_up_rows(rng: np.random.Generator) -> None:
    w = (rng.standard_normal((2 * 136, 128)) * 0.5).astype(BF16).view(np.uint16)
    got = prepare_weight(w, gated=True)
    want = prepare_weight(np.ascontiguousarray(interleaved(w)))
    assert got.gated and not want.gated and np.array_equal(got.data, want.data)
    assert np.array_equal(interleaved(w)[1::2], w[136:])  # up j at row 2j + 1
    with pytest.raises(ValueError, match="2 x I rows"):
        prepare_weight(w[:-1], gated=True)


@pytest.mark.parametrize("shape", [(272, 192), (272, 1024)], ids=["S1", "split"])
def test_the_gated_epilogue_gives_silu_mul_of_the_plain_product_on_every_route(
    lib: ctypes.CDLL, emu_lib: ctypes.CDLL, rng: np.random.Generator, shape: tuple[int, int]
) -> None:
    """Every gated entry point (WHOLE on each ws tile, PARTIAL and the cluster split on each
    M <= 64 tile and WS, FOLD on WS), at M = 1, 7, 64, 100 and 300 where its tile takes
    that M: the bits of
    the same route's plain product on the un-interleaved weight followed by the silu_mul
    kernel (both emulated), and within one BF16 rounding of the NumPy twins. So the fused
    MLP changes no bit of a row, and no row depends on M."""
    from test_kernels_emulated import max_ulps

    from reprise.cuda.activation import silu_mul_ref

    n, k = shape
    x_all, w = operands(rng, 300, n, k)
    splits = split_k(n, k)
    assert (splits > 1) == (k == 1024)
    for m, start in ((1, 0), (1, 299), (7, 100), (64, 3), (100, 50), (300, 0)):
        x = np.ascontiguousarray(x_all[start : start + m])
        plans: list[tuple[Sm90Launch, Sm90Launch]] = []
        if splits == 1:
            tiles = [WS, WS_WIDE, *((WS_DECODE, WS_M64) if m <= 64 else ())]
            plans = [(whole_plan(c, m, n, gated=True), whole_plan(c, m, n, gated=False)) for c in tiles]
        else:
            routes = ["ws_fold"] + (["ws_split", "ws_csplit"] if m <= WS.block_m else [])
            routes += ["decode_split", "m64_split", "decode_csplit", "m64_csplit"] if m <= 64 else []
            for route in routes:
                pair = [launch_plan(m, n, k, out_f32=False, packed=True, route=route, gated=g)
                        for g in (True, False)]  # fmt: skip
                plans.append((pair[0], pair[1]))
        assert plans
        for gated_plan, plain_plan in plans:
            assert gated_plan.kernel == plain_plan.kernel.replace("_bf16", "_gated")
            assert (gated_plan.grid, gated_plan.splits) == (plain_plan.grid, plain_plan.splits)
            if plain_plan.splits == 1:  # the WHOLE ws entry points: run_gemm_sm90_ws's tiles
                tile = {"": {}, "_wide": {"wide": True}, "_decode": {"decode": True},
                        "_m64": {"m64": True}}[plain_plan.kernel.removeprefix("gemm_sm90_ws_bf16")]  # fmt: skip
                plain = emulated_ws(lib, x, w, out_f32=False, **tile)
            else:
                plain = emulated_plan(lib, plain_plan, x, w, out_f32=False)
            want = poisoned((m, n // 2), np.uint16)
            emu_lib.run_silu_mul(ptr(np.ascontiguousarray(plain)), ptr(want), ctypes.c_longlong(m),
                                 n // 2, 3)  # fmt: skip
            got = emulated_gated(lib, gated_plan, x, w)
            assert np.array_equal(bits(got), want), (gated_plan.kernel, m, start)
            assert max_ulps(got, silu_mul_ref(plain)) <= 1


def emulated_plain(
    lib: ctypes.CDLL, config: Sm90WsConfig, x: np.ndarray, w: np.ndarray
) -> tuple[Sm90Launch, np.ndarray]:
    """The plain BF16 launch of a 256-thread tile (WS_DECODE or WS_M64) that a row epilogue
    extends, WHOLE or PARTIAL as the weight splits, and its product on the emulation."""
    (m, k), n = x.shape, w.shape[0]
    if split_k(n, k) == 1:
        plan = whole_plan(config, m, n, gated=False)
        plain = emulated_ws(lib, x, w, out_f32=False, decode=config is WS_DECODE,
                            m64=config is WS_M64)  # fmt: skip
        return plan, plain
    route = "decode_split" if config is WS_DECODE else "m64_split"
    plan = launch_plan(m, n, k, out_f32=False, packed=True, route=route)
    return plan, emulated_plan(lib, plan, x, w, out_f32=False)


def emulated_epilogue(
    lib: ctypes.CDLL, plan: Sm90Launch, x: np.ndarray, w: np.ndarray, run: Any,
    tail: tuple[Any, ...], order: np.ndarray | None, schedule: int = 0,
) -> np.ndarray:  # fmt: skip
    """A row epilogue's launch on the emulation through `run` (run_gemm_sm90_norm or
    run_gemm_sm90_rope), `tail` its arguments after split_len, as the launcher makes it:
    y and the workspace poisoned, y with a guard past its end; the counters zero and checked
    zero after; `order` the order the CTAs run and finish in; `schedule` how a CTA's
    threads take turns (cuda_emu.h's g_warp_major: 1 and 2 run one warp at a time as far as
    it goes alone, so a warp overwriting shared memory another has still to read shows).
    Returns y."""
    (m, k), n = x.shape, w.shape[0]
    packed = prepare_weight(np.ascontiguousarray(w).view(np.uint16))
    y = poisoned((m * n + GUARD,), np.uint16)
    ws = poisoned((plan.splits * m * n + GUARD,), np.float32)
    counters = np.zeros(plan.grid[0] * plan.grid[1] + plan.grid[0] + GUARD, np.uint32)
    if order is not None:
        order = np.ascontiguousarray(order, dtype=np.uint32)
        lib.set_cta_order(ptr(order))
    lib.set_warp_major(schedule)
    try:
        rc = run(
            plan.kernel.encode(), *plan.grid, plan.threads, plan.smem_bytes,
            ptr(np.ascontiguousarray(x).view(np.uint16)), ptr(packed.data), ptr(ws), ptr(y),
            ptr(counters), m, n, k, plan.split_len, *tail,
        )  # fmt: skip
    finally:
        lib.set_cta_order(None)
        lib.set_warp_major(0)
    assert rc == 0, (plan.kernel, rc)
    assert not counters.any(), "every counter left zero for the next launch"
    assert np.array_equal(y[m * n :], poisoned((GUARD,), np.uint16))
    return y[: m * n].reshape(m, n).view(BF16)


def schedules(
    plan: Sm90Launch, rng: np.random.Generator, *, every: bool
) -> list[tuple[np.ndarray | None, int]]:
    """The (CTA order, thread schedule) pairs a row epilogue is run under: launch order,
    reversed and shuffled CTAs, then launch order with one warp at a time ahead of the
    rest, first to last and last to first (emulated_epilogue); with `every` False, only
    the first."""
    ctas = plan.grid[0] * plan.grid[1]
    runs = [(None, 0), (np.arange(ctas)[::-1], 0), (rng.permutation(ctas), 0), (None, 1), (None, 2)]
    return runs if every else runs[:1]


def emulated_norm(
    lib: ctypes.CDLL, plan: Sm90Launch, x: np.ndarray, w: np.ndarray, residual: np.ndarray,
    norm_weight: np.ndarray, eps: float, *, order: np.ndarray | None = None, schedule: int = 0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """A norm epilogue's launch on the emulation (`emulated_epilogue`): (y, summed, normed),
    the outputs poisoned first with a guard past their end."""
    m, n = x.shape[0], w.shape[0]
    assert plan.epilogue == "norm" and residual.shape == (m, n)
    summed = poisoned((m * n + GUARD,), np.float32)
    normed = poisoned((m * n + GUARD,), np.uint16)
    tail = (ptr(np.ascontiguousarray(residual)), ptr(np.ascontiguousarray(norm_weight)),
            ptr(summed), ptr(normed), ctypes.c_float(eps))  # fmt: skip
    y = emulated_epilogue(lib, plan, x, w, lib.run_gemm_sm90_norm, tail, order, schedule)
    for out in (summed, normed):
        assert np.array_equal(bits(out[m * n :]), bits(poisoned((GUARD,), out.dtype)))
    return y, summed[: m * n].reshape(m, n), normed[: m * n].reshape(m, n).view(BF16)


# (N, K): the default model's o (S = 3) and down (S = 6); one k-tile (S = 1: WHOLE); a
# row of 4,160 elements, past what add_rmsnorm's registers hold (its looping path), S = 1
@pytest.mark.parametrize("shape", [(576, 576), (576, 1536), (200, 64), (4160, 64)],
                         ids=["o", "down", "S1", "long_row"])  # fmt: skip
def test_the_norm_epilogue_gives_add_rmsnorm_of_the_plain_product(
    lib: ctypes.CDLL, emu_lib: ctypes.CDLL, rng: np.random.Generator, shape: tuple[int, int]
) -> None:
    """Every norm entry point (the decode tile and the 64 x 128 tile, WHOLE or PARTIAL as
    the weight splits), at every M it takes (1 to EPILOGUE_MAX_ROWS), CTAs finishing
    in launch order, reversed and shuffled, and with one warp at a time running ahead
    (its rows' reductions share one scratch: a missing barrier between rows shows as
    other bits): y the plain entry point's bits, and (summed,
    normed) the bits of the add_rmsnorm kernel on that y (both emulated), within one BF16
    rounding of the NumPy twin. So the fused norm changes no bit, whichever CTA is last."""
    from test_kernels_emulated import max_ulps

    from reprise.cuda.gemm_sm90_plan import EPILOGUE_MAX_ROWS
    from reprise.cuda.rmsnorm import add_rmsnorm_ref

    n, k = shape
    splits = split_k(n, k)
    assert (splits > 1) == (k > 64), splits
    x_all, w = operands(rng, EPILOGUE_MAX_ROWS, n, k)
    residual_all = (rng.standard_normal((EPILOGUE_MAX_ROWS, n)) * 4).astype(F32)
    norm_weight = (1 + 0.25 * rng.standard_normal(n)).astype(BF16)
    eps = 1e-5
    for m in range(1, EPILOGUE_MAX_ROWS + 1):
        x, residual = np.ascontiguousarray(x_all[:m]), np.ascontiguousarray(residual_all[:m])
        for config in (WS_DECODE, WS_M64):
            plain_plan, plain = emulated_plain(lib, config, x, w)
            plan = epilogue_launch(plain_plan, m, "norm")
            assert plan is not None and plan.kernel == plain_plan.kernel.replace("_bf16", "_norm")
            want_summed, want_normed = np.empty_like(residual), poisoned((m, n), np.uint16)
            emu_lib.run_add_rmsnorm(m, ptr(residual), ptr(np.ascontiguousarray(plain)),
                                    ptr(norm_weight), ptr(want_summed), ptr(want_normed), n,
                                    ctypes.c_float(eps))  # fmt: skip
            for order, schedule in schedules(plan, rng, every=m in (1, EPILOGUE_MAX_ROWS)):
                y, summed, normed = emulated_norm(lib, plan, x, w, residual, norm_weight, eps,
                                                  order=order, schedule=schedule)  # fmt: skip
                where = (plan.kernel, m, None if order is None else order[:4], schedule)
                assert np.array_equal(bits(y), bits(plain)), where
                assert np.array_equal(bits(summed), bits(want_summed)), where
                assert np.array_equal(bits(normed), bits(want_normed)), where
            ref_summed, ref_normed = add_rmsnorm_ref(residual, plain, norm_weight, eps)
            assert np.array_equal(summed, ref_summed)
            assert max_ulps(normed, ref_normed) <= 1


class RopeCase:
    """A rope epilogue's inputs beside the qkv product: positions, tables, slots and a
    cache of random bytes (untouched slots must keep them)."""

    def __init__(self, rng: np.random.Generator, m: int, heads: int, kv_heads: int,
                 head_dim: int) -> None:  # fmt: skip
        from reprise.cuda.kvcache import kv_cache_shape
        from reprise.cuda.rope import rope_table

        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.layers, self.layer, self.block_size, blocks = 3, 1, 16, 4
        self.cos, self.sin = rope_table(head_dim, 4096, 500000.0)
        self.positions = rng.integers(0, 4096, m).astype(np.int32)
        self.slots = rng.choice(blocks * self.block_size, m, replace=False).astype(np.int64)
        shape = kv_cache_shape(blocks, self.layers, kv_heads, self.block_size, head_dim)
        self.cache = rng.standard_normal(shape).astype(BF16)

    def tail(self, q_out: np.ndarray, cache: np.ndarray) -> tuple[Any, ...]:
        """The entry point's arguments after split_len (and run_rope_kv_write's after q_out)."""
        return (ptr(self.positions), ptr(self.cos), ptr(self.sin), ptr(q_out), ptr(self.slots),
                ptr(cache), self.layer, self.layers, self.heads, self.kv_heads, self.block_size,
                self.head_dim)  # fmt: skip


def emulated_rope(
    lib: ctypes.CDLL, plan: Sm90Launch, x: np.ndarray, w: np.ndarray, case: RopeCase, *,
    order: np.ndarray | None = None, schedule: int = 0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """A rope epilogue's launch on the emulation (`emulated_epilogue`): (y, q_out, cache),
    q_out poisoned first with a guard past its end, the cache a copy of the case's."""
    assert plan.epilogue == "rope"
    q_size = x.shape[0] * case.heads * case.head_dim
    q_out = poisoned((q_size + GUARD,), np.uint16)
    cache = case.cache.copy()
    y = emulated_epilogue(lib, plan, x, w, lib.run_gemm_sm90_rope, case.tail(q_out, cache), order,
                          schedule)  # fmt: skip
    assert np.array_equal(q_out[q_size:], poisoned((GUARD,), np.uint16))
    return y, q_out[:q_size].view(BF16), cache


# (heads, kv_heads, head_dim, K): the default model's qkv (N = 960, K = 576: S = 3); an
# 8B-like head of 128 (two decode tiles a head) with one k-tile (S = 1: WHOLE)
@pytest.mark.parametrize("layout", [(9, 3, 64, 576), (4, 2, 128, 64)], ids=["default", "d128_S1"])
def test_the_rope_epilogue_gives_rope_kv_write_of_the_plain_product(
    lib: ctypes.CDLL, emu_lib: ctypes.CDLL, rng: np.random.Generator,
    layout: tuple[int, int, int, int],
) -> None:  # fmt: skip
    """Every rope entry point (the decode tile and the 64 x 128 tile, WHOLE or PARTIAL as
    the weight splits) at M = 1 to EPILOGUE_MAX_ROWS, CTAs finishing in launch order,
    reversed and shuffled, and one warp at a time running ahead: y the plain entry
    point's bits, and the queries and the whole cache (the keys rotated and values copied
    into their slots, every other byte as it was) the bits of the rope_kv_write kernel on
    that y (both emulated) and of its twin. So the fused rope changes no bit, whichever
    CTA is last."""
    from reprise.cuda.gemm_sm90_plan import EPILOGUE_MAX_ROWS
    from reprise.cuda.kvcache import rope_kv_write_ref

    heads, kv_heads, head_dim, k = layout
    n = (heads + 2 * kv_heads) * head_dim
    splits = split_k(n, k)
    assert (splits > 1) == (k > 64), splits
    x_all, w = operands(rng, EPILOGUE_MAX_ROWS, n, k)
    for m in range(1, EPILOGUE_MAX_ROWS + 1):
        x, case = np.ascontiguousarray(x_all[:m]), RopeCase(rng, m, heads, kv_heads, head_dim)
        for config in (WS_DECODE, WS_M64):
            plain_plan, plain = emulated_plain(lib, config, x, w)
            plan = epilogue_launch(plain_plan, m, "rope")
            assert plan is not None and plan.kernel == plain_plan.kernel.replace("_bf16", "_rope")
            want_cache, want_q = case.cache.copy(), poisoned((m, heads, head_dim), np.uint16)
            emu_lib.run_rope_kv_write(m, heads, kv_heads, ptr(np.ascontiguousarray(plain)),
                                      ctypes.c_longlong(n), ptr(case.positions), ptr(case.cos),
                                      ptr(case.sin), ptr(want_q), ptr(case.slots), ptr(want_cache),
                                      case.layer, case.layers, case.block_size, head_dim)  # fmt: skip
            for order, schedule in schedules(plan, rng, every=m in (1, EPILOGUE_MAX_ROWS)):
                y, q, cache = emulated_rope(lib, plan, x, w, case, order=order, schedule=schedule)
                where = (plan.kernel, m, None if order is None else order[:4], schedule)
                assert np.array_equal(bits(y), bits(plain)), where
                assert np.array_equal(bits(q), want_q.reshape(-1)), where
                assert np.array_equal(bits(cache), bits(want_cache)), where
            ref_cache = case.cache.copy()
            ref_q = rope_kv_write_ref(plain.reshape(m, -1, head_dim), case.positions, case.cos,
                                      case.sin, ref_cache, case.layer, case.slots, heads)  # fmt: skip
            assert np.array_equal(bits(q), bits(ref_q).reshape(-1))
            assert np.array_equal(bits(cache), bits(ref_cache))
            assert not np.array_equal(bits(cache), bits(case.cache))  # the slots were written


def test_epilogue_launch_takes_the_256_thread_tiles_up_to_its_rows(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The row epilogues extend the BF16 WHOLE and PARTIAL launches of the decode tile and
    the 64 x 128 tile up to EPILOGUE_MAX_ROWS rows, the same geometry (a cluster split of
    those tiles: its tile's PARTIAL launch); nothing else (WS's 384 threads, fp32 or gated
    output, more rows) has one."""
    from reprise.cuda import gemm_sm90_plan
    from reprise.cuda.gemm_sm90_plan import EPILOGUE_MAX_ROWS

    for n, k in ((576, 576), (576, 1536), (960, 576), (4096, 4096), (6144, 4096)):
        for m in range(1, 70):
            for route in (None, "decode_split", "m64_split", "ws_split", "decode_csplit"):
                if route is not None and split_k(n, k) == 1:
                    continue
                plain = launch_plan(m, n, k, out_f32=False, packed=True, route=route)
                takes = plain.kernel.startswith(("gemm_sm90_ws_bf16_decode", "gemm_sm90_ws_bf16_m64"))
                takes = takes and m <= EPILOGUE_MAX_ROWS
                # a cluster split's tile takes its epilogue on PARTIAL (the same grid and bits)
                partial = plain
                if plain.kernel.endswith("_csplit"):
                    with monkeypatch.context() as unclustered:
                        unclustered.setattr(gemm_sm90_plan, "CSPLIT_BY_DEFAULT", False)
                        partial = launch_plan(m, n, k, out_f32=False, packed=True,
                                              route=route and route.replace("_csplit", "_split"))  # fmt: skip
                for epilogue in ("norm", "rope"):
                    got = epilogue_launch(plain, m, epilogue)
                    if not takes:
                        assert got is None, (plain.kernel, m)
                        continue
                    assert got is not None and got.epilogue == epilogue and not plain.epilogue
                    assert got.kernel == partial.kernel.replace("_bf16_", f"_{epilogue}_")
                    assert got.cluster == 1 and "_csplit" not in got.kernel
                    assert (got.grid, got.threads, got.smem_bytes, got.splits, got.split_len,
                            got.workspace) == (partial.grid, partial.threads, partial.smem_bytes,
                                               partial.splits, partial.split_len, partial.workspace)  # fmt: skip
    for out_f32, gated in ((True, False), (False, True)):
        plain = launch_plan(1, 576, 576, out_f32=out_f32, packed=True, gated=gated)
        assert epilogue_launch(plain, 1, "norm") is None
    with pytest.raises(ValueError, match="epilogue must be one of norm, rope; got 'silu'"):
        epilogue_launch(launch_plan(1, 576, 576, out_f32=False, packed=True), 1, "silu")


def emulation_kernels(lib: ctypes.CDLL, launches: list[str]) -> Any:
    """A stand-in for gemm_sm90_kernel._kernel whose launches run on the emulation (the
    ws tiles' WHOLE, PARTIAL and row-epilogue entry points), each name recorded."""

    def fake_kernel(name: str, smem_bytes: int, device_id: int, swizzle: bool,
                    pad_once: bool, ablate: int = 0) -> Any:  # fmt: skip
        assert ablate == 0, "the kernel as it is: an ablation build is the benchmark's alone"

        def launch(grid_xy: tuple[int, int], block: tuple[int], args: tuple, *,
                   shared_mem: int) -> None:  # fmt: skip
            launches.append(name)
            head = (*grid_xy, block[0], shared_mem)
            if name.startswith(("gemm_sm90_ws_norm_", "gemm_sm90_ws_rope_")):
                # arrays by pointer, integers as ints, the norm's eps as a float
                def as_arg(a: Any) -> Any:
                    if isinstance(a, np.floating):
                        return ctypes.c_float(float(a))
                    return int(a) if isinstance(a, (np.integer, int)) else ptr(a)

                run = lib.run_gemm_sm90_norm if "_norm_" in name else lib.run_gemm_sm90_rope
                rc = run(name.encode(), *head, *map(as_arg, args))
            elif len(args) == 6:  # WHOLE
                x, w, y, m, n, k = args
                tile = 2 if name.endswith("_decode") else 3 if name.endswith("_m64") else 0
                rc = lib.run_gemm_sm90_ws(0, tile, *head, ptr(x), ptr(w), ptr(y), int(m), int(n),
                                          int(k))  # fmt: skip
            else:  # PARTIAL
                x, w, ws, y, counters, *dims = args
                rc = lib.run_gemm_sm90_split(name.encode(), *head, ptr(x), ptr(w), ptr(ws), ptr(y),
                                             ptr(counters), *map(int, dims))  # fmt: skip
            assert rc == 0, (name, rc)
            assert not COUNTERS.any(), "every launch leaves its counters zero"

        return launch

    return fake_kernel


def emulate_the_launcher(monkeypatch: pytest.MonkeyPatch, lib: ctypes.CDLL,
                         launches: list[str]) -> None:  # fmt: skip
    """gemm_sm90_kernel's device calls replaced by the emulation (an H100's 132 SMs)."""
    from reprise.cuda import gemm_sm90_kernel as launcher

    monkeypatch.setattr(launcher, "_kernel", emulation_kernels(lib, launches))
    monkeypatch.setattr(launcher, "device_arch", lambda: "90")
    monkeypatch.setattr(launcher, "_num_sms", lambda: 132)
    monkeypatch.setattr(launcher, "_device_id", lambda: 0)
    monkeypatch.setattr(launcher, "stream_counters", lambda launches, size, device_id: COUNTERS)
    monkeypatch.setitem(sys.modules, "cupy", _NumpyAsCupy)
    monkeypatch.setattr(pdl, "active", lambda: "0")  # CuPy's launch (the fake kernel's call)


# (M, fused, flag, one launch): asked by `fused` or by the flag, and planned (M <= 4)
EPILOGUE_CHOICES = [(1, True, False, True), (4, None, True, True), (3, None, False, False),
                    (5, True, True, False), (2, False, True, False)]  # fmt: skip


def test_gemm_sm90_add_rmsnorm_launches_the_norm_epilogue_where_asked_and_planned(
    lib: ctypes.CDLL, emu_lib: ctypes.CDLL, rng: np.random.Generator,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """gemm_sm90_add_rmsnorm itself, its device calls replaced by the emulation: asked
    (`fused`, or NORM_EPILOGUE_BY_DEFAULT) and planned (M <= EPILOGUE_MAX_ROWS), one
    norm launch whose arguments run it to the bits of the product then add_rmsnorm, which
    it runs otherwise; a weight it cannot take, or operands of other shapes, refused."""
    from reprise.cuda import gemm_sm90_kernel as launcher
    from reprise.cuda import gemm_sm90_plan, launchers

    launches: list[str] = []

    def fake_add_rmsnorm(residual: np.ndarray, delta: np.ndarray, weight: np.ndarray,
                         eps: float) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
        launches.append("add_rmsnorm")
        summed, normed = np.empty_like(residual), poisoned(residual.shape, np.uint16)
        emu_lib.run_add_rmsnorm(residual.shape[0], ptr(residual), ptr(delta), ptr(weight),
                                ptr(summed), ptr(normed), residual.shape[1], ctypes.c_float(eps))  # fmt: skip
        return summed, normed

    emulate_the_launcher(monkeypatch, lib, launches)
    # the unfused product on PARTIAL (the cluster split launches through the driver; with
    # it on, below, the epilogue runs on its tile's PARTIAL route all the same)
    monkeypatch.setattr(gemm_sm90_plan, "CSPLIT_BY_DEFAULT", False)
    monkeypatch.setattr(launchers, "add_rmsnorm", fake_add_rmsnorm)
    n, k = 576, 576  # the default model's o: S = 3
    x_all, w = operands(rng, 5, n, k)
    packed = prepare_weight(w.view(np.uint16))
    residual_all = (rng.standard_normal((5, n)) * 4).astype(F32)
    norm_weight = (1 + 0.25 * rng.standard_normal(n)).astype(BF16).view(np.uint16)
    for m, fused, flag, one_launch in EPILOGUE_CHOICES:
        monkeypatch.setattr(gemm_sm90_plan, "NORM_EPILOGUE_BY_DEFAULT", flag)
        x = np.ascontiguousarray(x_all[:m]).view(np.uint16)
        residual = np.ascontiguousarray(residual_all[:m])
        launches.clear()
        got = launcher.gemm_sm90_add_rmsnorm(x, packed, residual, norm_weight, 1e-5, fused=fused)
        assert launches == (["gemm_sm90_ws_norm_decode_split"] if one_launch
                            else ["gemm_sm90_ws_bf16_decode_split", "add_rmsnorm"]), (m, fused, flag)  # fmt: skip
        want = fake_add_rmsnorm(residual, gemm_sm90(x, packed), norm_weight, 1e-5)
        for g, wnt in zip(got, want, strict=True):
            assert np.array_equal(bits(g), bits(wnt)), (m, fused, flag)
    # with the cluster split the default, the epilogue still runs (on the tile's PARTIAL)
    monkeypatch.setattr(gemm_sm90_plan, "CSPLIT_BY_DEFAULT", True)
    x, residual = x_all[:1].view(np.uint16), residual_all[:1]
    launches.clear()
    launcher.gemm_sm90_add_rmsnorm(x, packed, residual, norm_weight, 1e-5, fused=True)
    assert launches == ["gemm_sm90_ws_norm_decode_split"]
    with pytest.raises(ValueError, match="takes a plain PackedWeight"):
        launcher.gemm_sm90_add_rmsnorm(x, w.view(np.uint16), residual, norm_weight, 1e-5)
    with pytest.raises(ValueError, match=r"residual must be \[M, N\] = \[1, 576\] and weight \[N\]"):
        launcher.gemm_sm90_add_rmsnorm(x, packed, residual_all[:2], norm_weight, 1e-5)
    with pytest.raises(ValueError, match=r"residual must be \[M, N\]"):
        launcher.gemm_sm90_add_rmsnorm(x, packed, residual, norm_weight[:-1], 1e-5)


def test_gemm_sm90_rope_kv_write_launches_the_rope_epilogue_where_asked_and_planned(
    lib: ctypes.CDLL, emu_lib: ctypes.CDLL, rng: np.random.Generator,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """gemm_sm90_rope_kv_write itself, its device calls replaced by the emulation: asked
    (`fused`, or ROPE_EPILOGUE_BY_DEFAULT) and planned, one rope launch whose arguments run
    it to the bits of the product then rope_kv_write (queries and cache), which it runs
    otherwise; a weight it cannot take, or a product that is not whole heads, refused."""
    from reprise.cuda import gemm_sm90_kernel as launcher
    from reprise.cuda import gemm_sm90_plan, launchers

    launches: list[str] = []

    def fake_rope_kv_write(qkv: np.ndarray, positions: np.ndarray, cos: np.ndarray,
                           sin: np.ndarray, cache: np.ndarray, layer: int, slots: np.ndarray,
                           heads: int) -> np.ndarray:  # fmt: skip
        launches.append("rope_kv_write")
        tokens, width, head_dim = qkv.shape
        kv_heads = (width - heads) // 2
        q = poisoned((tokens, heads, head_dim), np.uint16)
        emu_lib.run_rope_kv_write(tokens, heads, kv_heads, ptr(np.ascontiguousarray(qkv)),
                                  ctypes.c_longlong(width * head_dim), ptr(positions), ptr(cos),
                                  ptr(sin), ptr(q), ptr(slots), ptr(cache), layer, cache.shape[1],
                                  cache.shape[4], head_dim)  # fmt: skip
        return q

    emulate_the_launcher(monkeypatch, lib, launches)
    monkeypatch.setattr(gemm_sm90_plan, "CSPLIT_BY_DEFAULT", False)  # as the norm's test
    monkeypatch.setattr(launchers, "rope_kv_write", fake_rope_kv_write)
    heads, kv_heads, head_dim, k = 9, 3, 64, 576  # the default model's qkv: S = 3
    n = (heads + 2 * kv_heads) * head_dim
    x_all, w = operands(rng, 5, n, k)
    packed = prepare_weight(w.view(np.uint16))
    for m, fused, flag, one_launch in EPILOGUE_CHOICES:
        monkeypatch.setattr(gemm_sm90_plan, "ROPE_EPILOGUE_BY_DEFAULT", flag)
        x = np.ascontiguousarray(x_all[:m]).view(np.uint16)
        case = RopeCase(rng, m, heads, kv_heads, head_dim)
        rope = (case.positions, case.cos, case.sin)
        got_cache, want_cache = case.cache.view(np.uint16).copy(), case.cache.view(np.uint16).copy()
        launches.clear()
        got = launcher.gemm_sm90_rope_kv_write(x, packed, *rope, got_cache, case.layer, case.slots,
                                               heads, fused=fused)  # fmt: skip
        assert launches == (["gemm_sm90_ws_rope_decode_split"] if one_launch
                            else ["gemm_sm90_ws_bf16_decode_split", "rope_kv_write"]), (m, fused, flag)  # fmt: skip
        qkv = gemm_sm90(x, packed).reshape(m, -1, head_dim)
        want = fake_rope_kv_write(qkv, *rope, want_cache, case.layer, case.slots, heads)
        assert np.array_equal(bits(got), bits(want)), (m, fused, flag)
        assert np.array_equal(got_cache, want_cache), (m, fused, flag)
    x, case = x_all[:1].view(np.uint16), RopeCase(rng, 1, heads, kv_heads, head_dim)
    args = (case.positions, case.cos, case.sin, case.cache.view(np.uint16), case.layer, case.slots,
            heads)  # fmt: skip
    with pytest.raises(ValueError, match="takes a plain PackedWeight"):
        launcher.gemm_sm90_rope_kv_write(x, w.view(np.uint16), *args)
    with pytest.raises(ValueError, match="must be whole heads of the cache's head_dim"):
        launcher.gemm_sm90_rope_kv_write(x, prepare_weight(w[:-8].view(np.uint16)), *args)
    with pytest.raises(ValueError, match=r"qkv must be \[T, 8 \+ 2 \* 3, 64\]"):
        launcher.gemm_sm90_rope_kv_write(x, packed, *args[:-1], 8)


def test_gated_plans_refuse_what_the_epilogue_cannot_take() -> None:
    """A gated launch is the plain one's tile, grid and route, named apart; it needs a
    packed weight, BF16 out and an even N, and has no wide FOLD."""
    for m in (1, 64, 65, 2048):
        for n, k in ((28672, 4096), (3072, 576), (6144, 4096), (2 * 1536, 576)):
            plain = launch_plan(m, n, k, out_f32=False, packed=True)
            gated = launch_plan(m, n, k, out_f32=False, packed=True, gated=True)
            assert gated.kernel == plain.kernel.replace("_bf16", "_gated") != plain.kernel
            assert (gated.grid, gated.splits, gated.split_len, gated.workspace, gated.gated) == (
                plain.grid, plain.splits, plain.split_len, plain.workspace, True)  # fmt: skip
    with pytest.raises(ValueError, match="packed weight of even N"):
        launch_plan(1, 4096, 4096, out_f32=False, packed=False, gated=True)
    with pytest.raises(ValueError, match="packed weight of even N"):
        launch_plan(1, 4096, 4096, out_f32=True, packed=True, gated=True)
    with pytest.raises(ValueError, match="packed weight of even N"):
        launch_plan(1, 4097, 4096, out_f32=False, packed=True, gated=True)
    with pytest.raises(ValueError, match="no wide FOLD"):
        launch_plan(4096, 4096, 4096, out_f32=False, packed=True, route="wide_fold", gated=True)


def test_the_source_declares_every_gated_entry_point() -> None:
    """Each gated launch launch_plan can name is an entry point of gemm_sm90.cu and of
    the emulation's driver."""
    source = (Path(__file__).parents[1] / "cuda" / "gemm_sm90.cu").read_text()
    driver = (EMU / "driver_sm90.cpp").read_text()
    names = {whole_plan(c, 1, 256, gated=True).kernel for c in (WS, WS_WIDE, WS_DECODE, WS_M64)}
    names |= {launch_plan(m, 272, 1024, out_f32=False, packed=True, route=r, gated=True).kernel
              for m, r in ((1, "ws_split"), (1, "decode_split"), (1, "m64_split"), (300, "ws_fold"),
                           (300, "tall_fold"))}  # fmt: skip
    assert len(names) == 9
    for name in names:
        assert f"\n{name}(" in source and f'"{name}"' in driver, name


# ---- clusters: two CTAs along M sharing each weight tile (the _c2 entry points) ----------


def cluster_cases() -> list[tuple[int, int, int, int]]:
    """(M, N, K, SMs) whose launch_plan (cluster=True) takes a cluster entry point: WS
    WHOLE (S = 1, the wide tile's grid under a wave), the wide WHOLE (2 SMs: its grid
    fills them), and WS FOLD (a split weight); at M = 130 the second m tile holds 2 rows
    (one active consumer of two), at 256 two whole tiles, at 512 two clusters along M."""
    return [(130, 200, 128, 132), (256, 272, 192, 132), (130, 272, 192, 2), (512, 200, 128, 2),
            (130, 272, 1024, 132), (256, 200, 640, 132), (512, 272, 1024, 132)]  # fmt: skip


@pytest.mark.parametrize("case", cluster_cases(), ids=lambda c: "x".join(map(str, c)))
def test_cluster_entry_points_give_the_bits_of_the_single_cta_launch(
    lib: ctypes.CDLL, rng: np.random.Generator, case: tuple[int, int, int, int]
) -> None:
    """Each cluster entry point (BF16, fp32 and gated out; WHOLE on WS and the wide tile,
    FOLD on WS) bit-equals the same launch without the cluster, emulated with the second
    CTA of each cluster started and run as late as a GPU may (kernel_emu's run_cta: so a
    missing cluster barrier or a release left out deadlocks or reads a CTA that left)."""
    m, n, k, sms = case
    x, w = operands(rng, m, n, k)
    for out_f32, gated in ((False, False), (True, False), (False, True)):
        single = launch_plan(m, n, k, out_f32=out_f32, packed=True, num_sms=sms, gated=gated,
                             cluster=False)  # fmt: skip
        paired = launch_plan(m, n, k, out_f32=out_f32, packed=True, num_sms=sms, gated=gated,
                             cluster=True)  # fmt: skip
        assert (single.cluster, paired.cluster) == (1, 2)
        assert paired.kernel == f"{single.kernel}_c2"
        assert (paired.grid, paired.threads, paired.smem_bytes, paired.split_len) == (
            single.grid, single.threads, single.smem_bytes, single.split_len)  # fmt: skip
        if gated:
            want = emulated_gated(lib, single, x, w)
            got = emulated_gated(lib, paired, x, w)
        else:
            if single.splits == 1:
                wide = single.kernel.endswith("_wide")
                want = emulated_ws(lib, x, w, out_f32=out_f32, wide=wide)
            else:
                want = emulated_plan(lib, single, x, w, out_f32=out_f32)
            got = emulated_plan(lib, paired, x, w, out_f32=out_f32)
            check_twin(got, x, w, out_f32=out_f32)
        assert np.array_equal(bits(got), bits(want)), (paired.kernel, m, n, k)


def test_a_cluster_launch_of_an_odd_grid_is_refused(lib: ctypes.CDLL, rng: np.random.Generator) -> None:
    """The emulation's driver refuses a cluster entry point on an odd grid.x (return 4), as
    a GPU refuses a grid that is not whole clusters; launch_plan never makes one."""
    x, w = operands(rng, 300, 200, 128)
    single = launch_plan(300, 200, 128, out_f32=False, packed=True, cluster=True)
    assert single.grid[0] == 3 and single.cluster == 1  # three m tiles: no pairs
    plan = replace(single, kernel=f"{single.kernel}_c2", cluster=2)
    packed = prepare_weight(w.view(np.uint16))
    y = poisoned((300 * 200,), np.uint16)
    rc = lib.run_gemm_sm90_split(
        plan.kernel.encode(), *plan.grid, plan.threads, plan.smem_bytes,
        ptr(np.ascontiguousarray(x).view(np.uint16)), ptr(packed.data), None, ptr(y), None,
        300, 200, 128, 0,
    )  # fmt: skip
    assert rc == 4
    assert np.array_equal(bits(y), bits(poisoned((300 * 200,), np.uint16)))  # nothing ran


def test_launch_plan_takes_a_cluster_only_where_two_m_tiles_share_a_weight_tile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Off by default (CLUSTER_BY_DEFAULT); asked for, or with the flag on, a cluster runs
    exactly where the launch is WS (WHOLE or FOLD) or the wide WHOLE on an even number of
    m tiles: never at M <= 128 (one m tile), on the decode tiles, the wide FOLD, the
    cp.async kernels or an odd count of m tiles; the launch is otherwise the same."""
    from reprise.cuda import gemm_sm90_plan as geometry

    for name, (n, k) in {**LLAMA_8B, "lm_head": LM_HEAD_8B}.items():
        for m in (1, 64, 65, 128, 129, 300, 512, 2048):
            base = launch_plan(m, n, k, out_f32=False, packed=True)
            assert base.cluster == 1 and not base.kernel.endswith("_c2")  # the default: off
            asked = launch_plan(m, n, k, out_f32=False, packed=True, cluster=True)
            suffix = base.kernel.removeprefix("gemm_sm90_ws_bf16")
            pairs = suffix in ("", "_wide", "_fold") and base.grid[0] % 2 == 0
            assert not pairs or m > 128, (name, m, base.kernel)
            assert asked.cluster == (2 if pairs else 1), (name, m, base.kernel)
            assert asked.kernel == base.kernel + ("_c2" if asked.cluster == 2 else "")
            assert replace(asked, kernel=base.kernel, cluster=1) == base
            plain = launch_plan(m, n, k, out_f32=False, packed=False, cluster=True)
            assert plain.cluster == 1  # the cp.async kernels have no cluster
    wide_fold = launch_plan(2048, 4096, 4096, out_f32=False, packed=True, route="wide_fold",
                            cluster=True)  # fmt: skip
    assert wide_fold.cluster == 1
    monkeypatch.setattr(geometry, "CLUSTER_BY_DEFAULT", True)
    assert launch_plan(2048, 6144, 4096, out_f32=False, packed=True).kernel.endswith("_fold_c2")
    assert launch_plan(2048, 6144, 4096, out_f32=False, packed=True, cluster=False).cluster == 1


def test_the_source_and_the_driver_declare_every_cluster_entry_point() -> None:
    """Each cluster launch launch_plan can name is an entry point of gemm_sm90.cu, declared
    in clusters of two, and of the emulation's driver."""
    source = (Path(__file__).parents[1] / "cuda" / "gemm_sm90.cu").read_text()
    driver = (EMU / "driver_sm90.cpp").read_text()
    names = set()
    for m, n, k, sms in cluster_cases():
        for out_f32, gated in ((False, False), (True, False), (False, True)):
            names.add(launch_plan(m, n, k, out_f32=out_f32, packed=True, num_sms=sms,
                                  gated=gated, cluster=True).kernel)  # fmt: skip
    assert len(names) == 9
    for name in names:
        assert f"GEMM_SM90_CLUSTER_OF_2 __launch_bounds__(384, 1)\n{name}(" in source, name
        assert f'"{name}"' in driver, name
    assert "#define GEMM_SM90_CLUSTER_OF_2 __cluster_dims__(2, 1, 1)" in source



# ---- the cluster split: a tile's S splits one cluster, folded through its shared memory ----


def test_launch_plan_takes_the_cluster_split_where_partial_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    """With CSPLIT_BY_DEFAULT off: PARTIAL. With the flag on, every launch that took
    a PARTIAL route takes the same tile's cluster split (S <= 8 CTAs a cluster: a weight
    split more ways keeps PARTIAL): PARTIAL's grid, blockIdx.x = m tile * S + split, no
    workspace, `cluster` = S; FOLD and WHOLE launches are unchanged."""
    from reprise.cuda import gemm_sm90_plan as geometry

    shapes = [*LLAMA_8B.values(), (960, 576), (576, 576), (3072, 576), (576, 1536), (272, 1024)]
    monkeypatch.setattr(geometry, "CSPLIT_BY_DEFAULT", False)
    before = {(m, n, k): launch_plan(m, n, k, out_f32=False, packed=True)
              for n, k in shapes for m in (1, 7, 64, 100, 128, 129, 2048)}  # fmt: skip
    monkeypatch.setattr(geometry, "CSPLIT_BY_DEFAULT", True)
    monkeypatch.setattr(geometry, "CSPLIT_MAX_WEIGHT_BYTES", None)  # every split weight
    taken = 0
    for (m, n, k), plain in before.items():
        plan = launch_plan(m, n, k, out_f32=False, packed=True)
        if not plain.workspace:
            assert plan == plain, (m, n, k)
            continue
        taken += 1
        assert plan.kernel == plain.kernel.replace("_split", "_csplit") != plain.kernel
        assert (plan.grid, plan.splits, plan.split_len, plan.threads, plan.smem_bytes) == (
            plain.grid, plain.splits, plain.split_len, plain.threads, plain.smem_bytes)  # fmt: skip
        assert (plan.workspace, plan.cluster) == (False, plan.splits)
        assert plan.grid[0] % plan.cluster == 0
    assert taken >= 20
    wide = 16 * 1024  # K split past 8 ways (S = 16 at N = 64: 1 tile) keeps PARTIAL
    many = launch_plan(1, 64, wide, out_f32=False, packed=True)
    assert many.splits > geometry.MAX_CLUSTER and many.workspace and many.cluster == 1
    with pytest.raises(ValueError, match="at most 8 splits"):
        launch_plan(1, 64, wide, out_f32=False, packed=True, route="decode_csplit")


def test_the_cluster_split_by_default_keeps_to_small_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    """With CSPLIT_BY_DEFAULT and the default CSPLIT_MAX_WEIGHT_BYTES (16 MiB), the default
    model's split projections take the cluster split and every 8B one keeps PARTIAL (the
    2026-11-30 H200 figures: faster on the one, slower on the other)."""
    from reprise.cuda import gemm_sm90_plan as geometry

    monkeypatch.setattr(geometry, "CSPLIT_BY_DEFAULT", True)
    assert geometry.CSPLIT_MAX_WEIGHT_BYTES == 16 << 20
    small = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2-135M's
    shapes = [(nk, True) for nk in small] + [(nk, False) for nk in LLAMA_8B.values()]
    taken = 0
    for (n, k), fits in shapes:
        plan = launch_plan(1, n, k, out_f32=False, packed=True)
        if plan.splits == 1:
            continue  # unsplit: nothing to cluster
        assert plan.kernel.endswith("_csplit") == fits, (n, k, plan.kernel)
        taken += fits
    assert taken >= 3
    assert geometry.csplit_fits(4096, 2048) and not geometry.csplit_fits(4096, 2049)


def test_gemm_sm90_launches_the_cluster_split_in_clusters_of_its_splits(
    lib: ctypes.CDLL, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gemm_sm90 on a cluster-split route launches through the driver's launch (pdl.launch)
    with clusters of S CTAs along x, programmatic only where PDL takes the launch; the
    emulation run from that launch gives PARTIAL's bits."""
    from reprise.cuda import gemm_sm90_kernel as launcher

    seen: list[tuple[str, int, bool]] = []

    class FakeDriver:
        def launch(self, fn: Any, grid_xy: Any, block: Any, args: Any, shared_mem: int, *,
                   programmatic: bool = True, cluster: int = 1, cooperative: bool = False) -> None:  # fmt: skip
            assert not cooperative  # the cluster split is not a cooperative launch
            seen.append((fn.name, cluster, programmatic))
            pdl.launch_config(grid_xy, block, shared_mem, 0, programmatic=programmatic,
                              cluster=cluster)  # fmt: skip
            x, w, y, *dims = args
            rc = lib.run_gemm_sm90_split(
                fn.name.encode(), *grid_xy, block[0], shared_mem, ptr(x), ptr(w), None, ptr(y),
                None, *map(int, dims),
            )  # fmt: skip
            assert rc == 0, rc

    class FakeKernel:
        def __init__(self, name: str) -> None:
            self.name = name

        def __call__(self, *args: Any, **kwargs: Any) -> None:
            raise AssertionError("a cluster launch must not go through CuPy's launch")

    monkeypatch.setattr(launcher, "_kernel", lambda name, *rest: FakeKernel(name))
    monkeypatch.setattr(launcher, "device_arch", lambda: "90")
    monkeypatch.setattr(launcher, "_num_sms", lambda: 132)
    monkeypatch.setattr(launcher, "_device_id", lambda: 0)
    monkeypatch.setitem(sys.modules, "cupy", _NumpyAsCupy)
    monkeypatch.setattr(pdl, "_driver", FakeDriver())
    m, n, k = 7, 272, 1024
    x, w = operands(rng, m, n, k)
    x_bits, packed = x.view(np.uint16), prepare_weight(w.view(np.uint16))
    want = emulated_plan(lib, launch_plan(m, n, k, out_f32=False, packed=True, route="decode_split"), x, w,
                         out_f32=False)  # fmt: skip
    for mode in ("0", "1"):
        monkeypatch.setattr(pdl, "active", lambda mode=mode: mode)
        got = gemm_sm90(x_bits, packed, route="decode_csplit", out=poisoned((m, n), np.uint16))
        assert np.array_equal(bits(got), bits(want))
    assert seen == [("gemm_sm90_ws_bf16_decode_csplit", 4, False),
                    ("gemm_sm90_ws_bf16_decode_csplit", 4, True)]  # fmt: skip
