"""Launch geometry of the Hopper GEMM (gemm_sm90.cu; launcher: gemm_sm90_kernel.py): its
tile configurations, which one a product takes, and the launch (`launch_plan`): entry
point, grid, threads, shared memory, split route. Plain functions of the shapes and the
device's multiprocessors, so tests check them without a GPU.

Every choice here changes speed only: every tile and route issues the same wgmma per
element in the same order, and folds a split weight's partials in the same order
(gemm_sm90_kernel's docstring, gemm_sm90.cu's argument), so no choice by M reaches a bit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .gemm_kernel import num_splits, split_k, split_length

BLOCK_K = 64  # K must be a multiple: no K tail, no branch among a k-tile's MMAs
MAX_GRID_Y = 65535
INT32_MAX = 2**31 - 1
H100_SMS = 132  # multiprocessors of an H100 SXM (the geometry functions' default)


@dataclass(frozen=True, slots=True)
class Sm90Config:
    """One instantiation of gemm_sm90.cu's kernel; the numbers repeat its `Sm90Tile<...>`.

    NOTE: the kernel traps when launched with other than `num_threads` threads or
    less than `smem_bytes` of dynamic shared memory, so a drift between the two
    files fails loudly on the first launch.
    """

    name: str
    block_m: int  # 64 rows per warpgroup
    block_n: int  # 128 columns per wgmma.m64n128k16
    num_stages: int

    @property
    def num_threads(self) -> int:
        return 128 * (self.block_m // 64)

    @property
    def smem_bytes(self) -> int:
        """The x and w tile ring: BLOCK_K BF16 values per row, no padding."""
        return self.num_stages * (self.block_m + self.block_n) * BLOCK_K * 2

    def kernel_name(self, out_f32: bool) -> str:
        return f"gemm_sm90_{'f32' if out_f32 else 'bf16'}_{self.name}"


@dataclass(frozen=True, slots=True)
class Sm90WsConfig:
    """gemm_sm90.cu's warp-specialized kernel (`Sm90WsTile<BM, BN, STAGES>`): one producer
    warpgroup and a consumer a 64 rows, the ring's stages guarded by mbarriers (2 a
    stage, 8 bytes each, after the tiles)."""

    name: str
    block_m: int  # 64 rows a consumer warpgroup
    block_n: int  # the columns a CTA owns (64: half of the instruction's 128, the rest padding)
    num_stages: int

    @property
    def num_threads(self) -> int:
        return 128 * (1 + self.block_m // 64)

    @property
    def smem_bytes(self) -> int:
        """The ring (x tile, then a w tile of max(block_n, 128) rows: whole m64n128
        instructions), then its mbarriers."""
        rows = self.block_m + max(self.block_n, 128)
        return self.num_stages * rows * BLOCK_K * 2 + 2 * 8 * self.num_stages

    def kernel_name(self, out_f32: bool, gated: bool = False) -> str:
        """The entry point: `gated` the SwiGLU epilogue's (BF16 out, [M, N / 2])."""
        tile = self.name.removeprefix("ws")  # "", "_wide", "_decode", "_m64"
        out = "gated" if gated else "f32" if out_f32 else "bf16"
        return f"gemm_sm90_ws_{out}{tile}"


WG1 = Sm90Config("wg1", 64, 128, num_stages=8)  # M <= 64: one warpgroup, deep ring
WG2 = Sm90Config("wg2", 128, 128, num_stages=6)
WG2_WIDE = Sm90Config("wg2wide", 128, 256, num_stages=4)  # when its grid fills the device
CONFIGS: tuple[Sm90Config, ...] = (WG1, WG2, WG2_WIDE)
WS = Sm90WsConfig("ws", 128, 128, num_stages=6)  # any M, on a PackedWeight
# Past one m tile where its grid fills the device: two consumers of 64 x 256 (128
# accumulators a thread: a FOLD keeps its totals in a workspace, not registers), half the
# x tile's loads and barrier waits per product of WS.
WS_WIDE = Sm90WsConfig("ws_wide", 128, 256, num_stages=4)
# M <= 64 (decode): one consumer, 64 columns owned of the m64n128 instruction's 128 (the
# rest padding), 2 CTAs an SM: twice WS's CTAs, where WS's decode grid is under a wave
# (o and down at M = 1: 128 CTAs on 132 SMs, 1 an SM; this: 256, one round).
WS_DECODE = Sm90WsConfig("ws_decode", 64, 64, num_stages=4)
# M <= 64 where WS's grid is a wave or more (gate_up, lm_head at decode): one consumer, all
# 128 columns owned, 2 CTAs an SM: WS's CTAs in half the rounds (gate_up at M = 1: 224
# CTAs, one round on 132 SMs instead of two), without WS's 128-row x tile and second
# consumer, idle at M <= 64.
WS_M64 = Sm90WsConfig("ws_m64", 64, 128, num_stages=4)
# Past one m tile on split weights (FOLD, with TALL_FOLD_BY_DEFAULT where `tall_fold` says):
# three consumers of 64 x 128, FOLD's running totals in registers (the producer's given
# to them), 192 x 128 outputs from a k-tile's 40 KB of x and w where WS's take 32 KB for
# 128 x 128: a fifth fewer tile bytes read from L2 a product. 512 threads, one CTA an SM.
WS_TALL = Sm90WsConfig("ws_tall", 192, 128, num_stages=5)


def grid(config: Sm90Config | Sm90WsConfig, num_rows: int, num_cols: int) -> tuple[int, int]:
    """(CTAs along M, CTAs along N) of a launch."""
    return -(-num_rows // config.block_m), -(-num_cols // config.block_n)


def waves(
    config: Sm90Config | Sm90WsConfig, num_rows: int, num_cols: int, num_sms: int = H100_SMS
) -> float:
    """CTAs over multiprocessors: each CTA's ~192 KB of shared memory fits one a multiprocessor."""
    gx, gy = grid(config, num_rows, num_cols)
    return gx * gy / num_sms


def tile_config(num_rows: int, num_cols: int, num_sms: int = H100_SMS) -> Sm90Config:
    """The configuration `gemm_sm90` runs: every one issues the same instruction per
    element, so choosing by M changes speed only, never a bit of the result."""
    if num_rows <= WG1.block_m:
        return WG1
    return WG2_WIDE if waves(WG2_WIDE, num_rows, num_cols, num_sms) >= 1 else WG2


def ws_config(num_rows: int, num_cols: int, num_sms: int = H100_SMS) -> Sm90WsConfig:
    """The warp-specialized tile of an unsplit product: the wide one past one m tile when
    its grid fills the device (a prefill); at M <= 64 the decode tile where WS's grid is
    under a wave (with DECODE_TILE_BY_DEFAULT), else the 64 x 128 tile (with
    M64_TILE_BY_DEFAULT); else WS. As for `tile_config`, the choice changes speed only:
    every tile issues the same wgmma per element."""
    if num_rows > WS.block_m and waves(WS_WIDE, num_rows, num_cols, num_sms) >= 1:
        return WS_WIDE
    if decode_tile(num_rows, num_cols, 1, num_sms):
        return WS_DECODE
    if m64_tile(num_rows):
        return WS_M64
    return WS


def l2_cost(config: Sm90WsConfig, num_rows: int, num_cols: int, num_sms: int = H100_SMS) -> int:
    """A launch's time in the model that picks the tall FOLD over WS's: its rounds of one
    CTA an SM times the tile bytes a CTA reads from L2 a k-tile ((BM + BN) rows of 64
    BF16s), as if the tiles' L2 reads bound a large-M product (2026-11-28's H200 figures
    imply 6.1-6.9 TB/s of them whatever the tile; CLUSTER_BY_DEFAULT's note)."""
    gx, gy = grid(config, num_rows, num_cols)
    return -(-gx * gy // num_sms) * (config.block_m + max(config.block_n, 128))


def tall_fold(num_rows: int, num_cols: int, num_sms: int = H100_SMS) -> bool:
    """Whether a FOLD of M > WS's rows takes the tall tile (route "tall_fold") instead of
    WS's: with TALL_FOLD_BY_DEFAULT on, where `l2_cost` says it reads less (8B's qkv, o and
    down at M = 2,048: 4 rounds of the tall tile against 6 of WS for qkv, 3 against 4 for
    o and down; at M = 512 both take 2 rounds or 1, and WS's CTA reads less)."""
    if not TALL_FOLD_BY_DEFAULT or num_rows <= WS.block_m:
        return False
    return l2_cost(WS_TALL, num_rows, num_cols, num_sms) < l2_cost(WS, num_rows, num_cols, num_sms)


def csplit_fits(n: int, k: int) -> bool:
    """Whether an [N, K] BF16 weight is small enough for the cluster split by default
    (CSPLIT_MAX_WEIGHT_BYTES)."""
    return CSPLIT_MAX_WEIGHT_BYTES is None or 2 * n * k <= CSPLIT_MAX_WEIGHT_BYTES


def m64_tile(num_rows: int) -> bool:
    """Whether a product of M <= 64 rows the decode tile does not take runs on WS_M64
    (WHOLE or PARTIAL), with M64_TILE_BY_DEFAULT on."""
    return M64_TILE_BY_DEFAULT and num_rows <= WS_M64.block_m


def decode_tile(num_rows: int, num_cols: int, splits: int, num_sms: int = H100_SMS) -> bool:
    """Whether a product of M <= 64 rows takes WS_DECODE (WHOLE or PARTIAL): where WS's
    grid (`splits` CTAs a tile) is under a wave, so twice the CTAs help, with
    DECODE_TILE_BY_DEFAULT on and its grid within the launch limit."""
    if not DECODE_TILE_BY_DEFAULT or num_rows > WS_DECODE.block_m:
        return False
    gx, gy = grid(WS, num_rows, num_cols)
    return gx * gy * splits < num_sms and grid(WS_DECODE, num_rows, num_cols)[1] <= MAX_GRID_Y


@dataclass(frozen=True, slots=True)
class Sm90Launch:
    """The one kernel launch of a product: entry point, grid, threads, dynamic shared
    memory, the split length it is passed (0: WHOLE, no split) and whether it takes the
    fp32 workspace and tile counters (PARTIAL)."""

    kernel: str
    grid: tuple[int, int]
    threads: int
    smem_bytes: int
    splits: int
    split_len: int
    workspace: bool  # PARTIAL: the [S, M, N] fp32 partials and the tile counters
    totals: bool = False  # the wide FOLD: the [M, N] fp32 running totals
    gated: bool = False  # the SwiGLU epilogue: y is [M, N / 2] (gemm_sm90.cu's gated entry points)
    cluster: int = 1  # CTAs a cluster along M sharing each weight tile (2: a `_c2` entry point)
    epilogue: str = ""  # a row epilogue's entry point (`epilogue_launch`): "norm" or "rope"


# The split routes (S > 1) by the kernel they run: (config, route).
SPLIT_ROUTES: dict[str, tuple[Sm90Config | Sm90WsConfig, str]] = {
    "wg1_split": (WG1, "split"),
    "wg2_fold": (WG2, "fold"),
    "ws_split": (WS, "split"),
    "ws_fold": (WS, "fold"),
    "wide_fold": (WS_WIDE, "fold"),  # FOLD_WS: the running totals in an [M, N] fp32 workspace
    "tall_fold": (WS_TALL, "fold"),  # three consumers, the running totals in registers
    "decode_split": (WS_DECODE, "split"),  # M <= 64
    "m64_split": (WS_M64, "split"),  # M <= 64
    # the cluster split: PARTIAL's CTAs, each tile's S splits a cluster, the partials folded
    # through the cluster's shared memory (no workspace, no counters; S <= MAX_CLUSTER)
    "ws_csplit": (WS, "csplit"),
    "decode_csplit": (WS_DECODE, "csplit"),  # M <= 64
    "m64_csplit": (WS_M64, "csplit"),  # M <= 64
}
MAX_CLUSTER = 8  # CTAs a cluster may hold on every sm_90 device (the portable size)
WIDE_FOLD_MAX_SPLITS = 4  # gemm_sm90.cu's FOLD_WS_MAX_SPLITS: its split loop is unrolled
# Whether launch_plan takes the wide FOLD (route "wide_fold") for split weights past one m
# tile. Off until a GPU has run it: its first run (H200, 2026-11-27) hung every wide
# launch on a setmaxnreg budget over the CTA's register pool, since fixed (gemm_sm90.cu,
# Sm90WsTile) and held by a static_assert, but not yet run. `route="wide_fold"` forces it
# (tests/test_gemm_sm90_pending_gpu.py, bench_gemm_sm90 --wide-fold).
WIDE_FOLD_BY_DEFAULT = False
# Whether launch_plan takes the tall tile (WS_TALL, route "tall_fold") for split weights past
# one m tile where `tall_fold` says it reads less from L2 than WS. Why: the 8B prefill's
# split projections (qkv, o, down at M = 2,048) run WS's 128 x 128 FOLD at 1.85-1.92x
# cuBLAS (H200, 2026-11-30), where the wide tile, which cannot fold in registers, runs
# their unsplit products 25-30 % faster; the tall tile folds in registers on a fifth more
# outputs a k-tile's bytes than WS. The same wgmma per element in the same order, so the
# same bits (emulated: tests/test_gemm_sm90.py). Off until a GPU has timed it
# (bench_gemm_sm90's `tall` column, gpu_followup's `tall_e2e` part).
TALL_FOLD_BY_DEFAULT = False
# Whether launch_plan takes the decode tile (WS_DECODE, routes "decode_split" and WHOLE)
# at M <= 64 where WS's grid is under a wave (`decode_tile`). On since the H200 run of
# 2026-11-28 (bench/results/2026-11-28-h200): its rows bit-equal WS's on the GPU
# (tests/test_gemm_sm90_pending_gpu.py), and with the 64 x 128 tile it took an 8B batch-1
# decode step's kernels from 5,741 to 5,407 µs (qkv, o and down's split launches 4-5 %
# faster inside the graph). Off: WS at every M.
DECODE_TILE_BY_DEFAULT = True
# Whether launch_plan takes the 64 x 128 tile (WS_M64, routes "m64_split" and WHOLE) at
# M <= 64 where the decode tile is not taken (`m64_tile`). On since the same run: the
# same bits as WS on the GPU, gate_up and lm_head at M = 1 8-10 % faster (64 vs 57 µs,
# 256 vs 235 µs alone; 1,989 vs 1,791 µs for 32 gate_ups in the decode graph).
M64_TILE_BY_DEFAULT = True
# Whether CupyBackend packs the fused gate/up weight for the gated (SwiGLU) epilogue where
# it takes the Hopper kernel, so the MLP's silu_mul runs inside the gate/up GEMM (one
# kernel a layer fewer, and no [M, 2I] product in memory: at an 8B prefill of 2,048 tokens
# 235 MB less traffic a layer). Bit-identical to the two kernels in the emulation (tests/
# test_gemm_sm90.py) and on the H200 (2026-12-01, tests/test_gemm_sm90_pending_gpu.py);
# on since that run: 8B decode b=1 4.90 ms against 5.02, prefill 2,048 74.3 ms against
# 77.0, the default model 733 tokens/s against 672 (bench/results/2026-12-01-h200).
GATED_BY_DEFAULT = True
# Whether launch_plan takes the cluster entry points (`_c2`: two CTAs along M, m tiles 2c
# and 2c + 1 of one n tile, each bringing half of every weight tile and multicasting it to
# both; gemm_sm90.cu's CLUSTER = 2) for WHOLE on WS and the wide tile and for FOLD on WS,
# where the m tiles are even in number (`cluster_pairs`). Why: at M = 2,048 on an H200
# (2026-11-28) the 128 x 128 FOLD and the wide WHOLE both imply 6.1-6.9 TB/s of tiles
# read from L2 (tile bytes over the measured times; no counter read it), whatever the
# tile, which suggests L2 bandwidth is their bound;
# sharing the weight tile cuts a CTA's L2 reads by a quarter (128 x 128: 32 to 24 KB a
# k-tile) or a third (wide: 48 to 32). The same wgmma per element in the same order, so
# the same bits (emulated: tests/test_gemm_sm90.py). Off until a GPU has run it
# (tests/test_gemm_sm90_pending_gpu.py, gpu_followup's `cluster` parts).
CLUSTER_BY_DEFAULT = False
# Whether launch_plan takes the cluster split (routes "*_csplit") where it would take
# PARTIAL (M up to the tile's rows) and the split count fits a cluster: the tile's S
# splits launched as one cluster (a launch attribute), each CTA stashing its fp32 partial
# in its own shared memory and folding a share of the tile's elements from all S stashes
# (the same fold, common.cuh's fold_partials_of), where PARTIAL goes through a global
# workspace, a device-wide fence and an atomic counter, and its last CTA folds alone. Why:
# on the H200 (2026-11-28, ncu_decode.txt) the split launches of a decode step stalled
# on barriers and memory fences ahead of their loads, and 96 of them a step (120 on the
# default model, ~9 µs each) spend that tail serially. The same bits (emulated:
# tests/test_gemm_sm90.py; on the H200 on 2026-12-01, tests/test_gemm_sm90_pending_gpu.py).
# On since that run, for weights up to CSPLIT_MAX_WEIGHT_BYTES: the default model 899
# tokens/s against 672 in the same run (bench/results/2026-12-01-h200).
CSPLIT_BY_DEFAULT = True
# With CSPLIT_BY_DEFAULT, the cluster split only for weights of at most this many bytes (N x
# K x 2; None: every split weight). On the H200 on 2026-11-30 (bench/results/2026-11-30-h200)
# the cluster split took the default model's decode from 778 to 924 tokens/s (its weights
# 0.7-3.5 MB) and the 8B decode step from 4.93 to 5.60 ms (its 33-235 MB): a split's
# PARTIAL tail weighs on a launch of a few µs, not on one of tens.
CSPLIT_MAX_WEIGHT_BYTES: int | None = 16 << 20
# Whether CupyBackend's gemm_add_rmsnorm (a decode's o and down projections, each then
# add_rmsnorm) takes the norm epilogue (`epilogue_launch`, "norm"): the product's own
# launch, once its last tile is written, runs the add_rmsnorm kernel's row function on its
# rows with the same 256 threads (gemm_sm90.cu's row_epilogue), so the same bits and one
# launch a projection fewer (60 a step on the default model, whose step is ~270 small
# kernels). Off until a GPU has run it (tests/test_gemm_sm90_pending_gpu.py,
# gpu_followup's `epilogues_default` and `fused_default` parts): emulated, bit-identical to
# the two kernels (tests/test_gemm_sm90.py).
NORM_EPILOGUE_BY_DEFAULT = False
# The same for CupyBackend's gemm_rope_kv_write (a decode's bias-free qkv projection, then
# rope_kv_write) and the rope epilogue ("rope"): the rope_kv_write kernel's own work item
# on each (row, head, pair), 30 launches a step fewer on the default model.
ROPE_EPILOGUE_BY_DEFAULT = False
# The most rows a row epilogue takes: its one CTA does all of them, where the kernels it
# replaces spread them over CTAs; past a few rows the second launch costs less (a
# batch-64 decode keeps the two kernels).
EPILOGUE_MAX_ROWS = 4
ROW_EPILOGUES = ("norm", "rope")
# The plain BF16 entry points the row epilogues extend (the 256-thread tiles, WHOLE and
# PARTIAL: add_rmsnorm's thread count); each epilogue's is named with "_norm" or "_rope"
# for "_bf16".
EPILOGUE_TILES = (
    "gemm_sm90_ws_bf16_decode",
    "gemm_sm90_ws_bf16_decode_split",
    "gemm_sm90_ws_bf16_m64",
    "gemm_sm90_ws_bf16_m64_split",
)
MAX_COUNTERS = MAX_GRID_Y + 1  # tile counters a stream holds: one per (n tile, m tile)


def cluster_pairs(config: Sm90Config | Sm90WsConfig, kind: str, m: int, n: int) -> bool:
    """Whether a launch of `config` (route kind "whole" or "fold") has a cluster entry point
    to take: a two-consumer warp-specialized tile (WS, or the wide one WHOLE) on an even
    number of m tiles (so each cluster's two m tiles both hold rows)."""
    tiles = grid(config, m, n)[0]
    two_consumers = config is WS or (config is WS_WIDE and kind == "whole")
    return two_consumers and tiles % 2 == 0


def _clustered(launch: Sm90Launch, config: Sm90Config | Sm90WsConfig, kind: str, m: int, n: int,
               cluster: bool | None) -> Sm90Launch:  # fmt: skip
    """`launch` on its cluster entry point where `cluster` (None: CLUSTER_BY_DEFAULT)
    asks for one and `cluster_pairs` allows it; else `launch` as it is."""
    wanted = CLUSTER_BY_DEFAULT if cluster is None else cluster
    if not wanted or not cluster_pairs(config, kind, m, n):
        return launch
    return replace(launch, kernel=f"{launch.kernel}_c2", cluster=2)


def launch_plan(
    m: int, n: int, k: int, *, out_f32: bool, packed: bool, num_sms: int = H100_SMS,
    route: str | None = None, splits: int | None = None, gated: bool = False,
    cluster: bool | None = None,
) -> Sm90Launch:  # fmt: skip
    """The launch `gemm_sm90` makes for an [M, K] x [N, K] product, M, N > 0: with
    S = split_k(N, K) = 1, WHOLE on `tile_config` (or the warp-specialized kernel for a
    packed weight); with S > 1, PARTIAL up to the tile's BM rows (one m tile: the
    decode grid S * ceil(N / 128)) and FOLD past it. `route` (a SPLIT_ROUTES key)
    forces a split route at any M, for tests: every route gives every M the same bits.
    `splits` (default split_k(N, K), what every caller should use: a weight's rows are
    only comparable across calls that split it alike) must cut K exactly; 1 forces WHOLE.
    `gated`: the SwiGLU epilogue's entry point of the same tile and route (a packed
    weight, BF16 out, N even; not the wide FOLD), the same geometry: it changes what a
    CTA stores, never what it sums. `cluster` (None: CLUSTER_BY_DEFAULT): the same launch
    on its cluster entry point where `cluster_pairs` allows one (`Sm90Launch.cluster`
    says which ran); the same geometry and bits."""
    if gated:
        if not packed or out_f32 or n % 2:
            raise ValueError(
                "the gated epilogue takes a packed weight of even N and BF16 out; got "
                f"packed={packed}, out_f32={out_f32}, N = {n}"
            )
        if route == "wide_fold":
            raise ValueError(
                "the gated epilogue has no wide FOLD (its totals are the [M, N] product)"
            )
    if splits is None:
        splits = split_k(n, k)
    elif splits < 1 or num_splits(k, split_length(k, splits)) != splits:
        raise ValueError(
            f"splits must be a count that split_length cuts K = {k} into exactly; got {splits}"
        )
    if splits == 1 and route is None:
        config: Sm90Config | Sm90WsConfig = (
            ws_config(m, n, num_sms) if packed else tile_config(m, n, num_sms)
        )
        name = (
            config.kernel_name(out_f32, gated) if isinstance(config, Sm90WsConfig)
            else config.kernel_name(out_f32)
        )  # fmt: skip
        whole = Sm90Launch(
            name, grid(config, m, n), config.num_threads, config.smem_bytes, 1, 0, False,
            gated=gated,
        )  # fmt: skip
        return _clustered(whole, config, "whole", m, n, cluster)
    if route is None:
        small = m <= (WS.block_m if packed else WG1.block_m)
        if not packed:
            route = "wg1_split" if small else "wg2_fold"
        elif small:
            route = (
                "decode_split" if decode_tile(m, n, splits, num_sms)
                else "m64_split" if m64_tile(m)
                else "ws_split"
            )  # fmt: skip
            if CSPLIT_BY_DEFAULT and splits <= MAX_CLUSTER and csplit_fits(n, k):
                route = route.replace("_split", "_csplit")
        else:
            wide = ws_config(m, n, num_sms) is WS_WIDE and splits <= WIDE_FOLD_MAX_SPLITS
            route = "wide_fold" if wide and WIDE_FOLD_BY_DEFAULT and not gated else "ws_fold"
            if route == "ws_fold" and tall_fold(m, n, num_sms):
                route = "tall_fold"
    if route not in SPLIT_ROUTES:
        raise ValueError(f"route must be one of {', '.join(SPLIT_ROUTES)}; got {route!r}")
    config, kind = SPLIT_ROUTES[route]
    if isinstance(config, Sm90WsConfig) != packed:
        needs = "packed" if isinstance(config, Sm90WsConfig) else "plain"
        raise ValueError(f"route {route} needs a {needs} weight")
    if route == "wide_fold" and splits > WIDE_FOLD_MAX_SPLITS:
        raise ValueError(
            f"route wide_fold takes at most {WIDE_FOLD_MAX_SPLITS} splits; got {splits}"
        )
    if kind == "csplit" and splits > MAX_CLUSTER:
        raise ValueError(
            f"route {route} takes at most {MAX_CLUSTER} splits (a cluster); got {splits}"
        )
    length = split_length(k, splits)
    tiles = grid(config, m, n)
    base = (
        config.kernel_name(out_f32, gated) if isinstance(config, Sm90WsConfig)
        else config.kernel_name(out_f32)
    )  # fmt: skip
    name = f"{base}_{kind}"
    if kind == "fold":
        wide = config is WS_WIDE
        if wide and m * n > INT32_MAX:
            raise ValueError(f"M * N must fit in int32; got {m} * {n}")
        fold = Sm90Launch(
            name, tiles, config.num_threads, config.smem_bytes, splits, length, False, wide,
            gated=gated,
        )  # fmt: skip
        return _clustered(fold, config, "fold", m, n, cluster)
    if kind == "csplit":  # PARTIAL's grid (blockIdx.x = m tile * S + split), one cluster a tile
        if tiles[0] * splits > INT32_MAX:
            raise ValueError(f"the split grid must fit in int32; got {tiles[0]} * {splits}")
        return Sm90Launch(
            name, (tiles[0] * splits, tiles[1]), config.num_threads, config.smem_bytes, splits,
            length, False, gated=gated, cluster=splits,
        )  # fmt: skip
    if splits * m * n > INT32_MAX or tiles[0] * splits > INT32_MAX:
        raise ValueError(f"S * M * N must fit in int32; got {splits} * {m} * {n}")
    if tiles[0] * tiles[1] > MAX_COUNTERS:
        raise ValueError(
            f"the split route takes at most {MAX_COUNTERS} tiles; got {tiles[0] * tiles[1]}"
        )
    return Sm90Launch(
        name, (tiles[0] * splits, tiles[1]), config.num_threads, config.smem_bytes, splits,
        length, True, gated=gated,
    )  # fmt: skip


def epilogue_launch(plan: Sm90Launch, m: int, epilogue: str) -> Sm90Launch | None:
    """`plan` (a BF16 product of `m` rows) on its row epilogue's entry point (`epilogue`
    "norm" or "rope"; a cluster split's on its tile's PARTIAL route), or None where there is
    none (another tile or route, fp32 or gated output, a two-CTA cluster) or `m` passes
    EPILOGUE_MAX_ROWS: then the caller runs the product and
    the epilogue's kernel apart, to the same bits. The same grid, threads and shared
    memory; the tile counters always (one past the fold's for the m tile, within
    MAX_COUNTERS)."""
    if epilogue not in ROW_EPILOGUES:
        raise ValueError(f"epilogue must be one of {', '.join(ROW_EPILOGUES)}; got {epilogue!r}")
    if plan.kernel.endswith("_csplit") and not plan.gated:
        # the cluster split's tile as PARTIAL (the same grid and bits): the epilogue counts
        # the tiles PARTIAL's folding CTAs finish, so it takes that route, not the cluster's
        kernel = plan.kernel.removesuffix("_csplit") + "_split"
        plan = replace(plan, kernel=kernel, workspace=True, cluster=1)
    if plan.kernel not in EPILOGUE_TILES or plan.gated or plan.cluster != 1:
        return None
    if not 0 < m <= EPILOGUE_MAX_ROWS:
        return None
    m_tiles = plan.grid[0] // plan.splits
    if (plan.grid[1] + 1) * m_tiles > MAX_COUNTERS:
        return None
    return replace(plan, kernel=plan.kernel.replace("_bf16", f"_{epilogue}"), epilogue=epilogue)


def decode_waves(n: int, k: int, *, packed: bool, num_sms: int = H100_SMS) -> float:
    """CTAs of the M = 1 launch of an (N, K) weight over multiprocessors, for the tile the
    settings choose: one WS CTA (~192 KB of shared memory) fits a multiprocessor, the
    decode tiles' two, so with DECODE_TILE_BY_DEFAULT or M64_TILE_BY_DEFAULT on a figure
    up to 2 is still one round."""
    plan = launch_plan(1, n, k, out_f32=False, packed=packed)
    return plan.grid[0] * plan.grid[1] / num_sms
