"""The pure parts of bench/bench_gpu_kernels.py, on the CPU: the floor arithmetic against
hand-derived counts, the GEMM shapes against daemon/model/synth.py's tensors, the BF16
rounding against ml_dtypes, the table, and the command line without a device (a
clear message, never a traceback). The measurements themselves need a GPU."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from reprise.bench import bench_gpu_kernels as bench
from reprise.cuda import nvrtc
from reprise.cuda.backend import cuda_device_available
from reprise.cuda.dtypes import BF16
from reprise.daemon.model.synth import SHAPES, tensor_shapes

SCRIPT = Path(__file__).parents[1] / "bench" / "bench_gpu_kernels.py"
LLAMA_8B = bench.ModelShape.of("llama-3.1-8b")
SMOLLM2 = bench.ModelShape.of("smollm2-135m")
# Round figures so that floors come out in whole microseconds.
FLOORS: bench.Floors = {bench.COPY_BW: 2e12, bench.MATMUL_RATE: 1e15, bench.D2H_BW: 5e10}


def test_gemm_shapes_of_llama_8b_by_hand() -> None:
    assert bench.gemm_shapes(LLAMA_8B) == [
        ("qkv", 6144, 4096, False),  # (32 + 2 * 8) heads * 128
        ("o", 4096, 4096, False),
        ("gate_up", 28672, 4096, False),
        ("down", 4096, 14336, False),
        ("lm_head", 128256, 4096, True),
    ]


@pytest.mark.parametrize("name", ["llama-3.1-8b", "smollm2-135m", "llama-3.2-1b"])
def test_gemm_shapes_match_the_synth_tensors(name: str) -> None:
    """Each GEMM's [N, K] is its Hugging Face weights' (fused along N) in synth's table."""
    tensors = dict(tensor_shapes({**SHAPES[name], "num_hidden_layers": 1}))
    layer = "model.layers.0."

    def fused(*names: str) -> tuple[int, int]:
        shapes = [tensors[layer + n + ".weight"] for n in names]
        assert len({k for _, k in shapes}) == 1, shapes
        return sum(n for n, _ in shapes), shapes[0][1]

    lm_head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
    expected = {
        "qkv": fused("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "o": fused("self_attn.o_proj"),
        "gate_up": fused("mlp.gate_proj", "mlp.up_proj"),
        "down": fused("mlp.down_proj"),
        "lm_head": lm_head,
    }
    shapes = bench.gemm_shapes(bench.ModelShape.of(name))
    assert {s.name: (s.n, s.k) for s in shapes} == expected
    assert [s.name for s in shapes if s.out_f32] == ["lm_head"]


def test_model_shape_refuses_an_unknown_model() -> None:
    with pytest.raises(ValueError, match=r"llama-3\.1-8b.*got 'gpt-2'"):
        bench.ModelShape.of("gpt-2")


def test_lm_head_is_timed_at_decode_sizes_only() -> None:
    rows = {s.name: bench.gemm_rows(s) for s in bench.gemm_shapes(SMOLLM2)}
    assert rows["lm_head"] == (1, 16, 64)
    assert rows["qkv"] == rows["down"] == (1, 16, 64, 512, 2048)


def test_gemm_bytes_and_flops_by_hand() -> None:
    m, n, k = 16, 6144, 4096
    assert bench.gemm_bytes(m, n, k) == 2 * (m * k + n * k + m * n)
    assert bench.gemm_bytes(m, n, k, out_f32=True) == 2 * (m * k + n * k) + 4 * m * n
    assert bench.gemm_bytes(1, 128256, 4096, out_f32=True) == 1_051_194_368
    assert bench.gemm_flops(m, n, k) == 2 * m * n * k == 805_306_368


def test_gemm_floor_is_bytes_at_decode_and_flops_at_prefill() -> None:
    # 8B gate_up: decode reads the 235 MB weight once; prefill of 2048 rows is 481 GFLOP.
    decode = bench.floor_us(bench.gemm_bytes(1, 28672, 4096), bench.gemm_flops(1, 28672, 4096), FLOORS)  # fmt: skip
    assert decode == (pytest.approx(2 * (4096 + 28672 * 4096 + 28672) / 2e12 * 1e6), "bytes")
    flops = bench.gemm_flops(2048, 28672, 4096)
    prefill = bench.floor_us(bench.gemm_bytes(2048, 28672, 4096), flops, FLOORS)
    assert prefill == (pytest.approx(flops / 1e15 * 1e6), "flops")
    assert prefill[0] == pytest.approx(481.036, abs=1e-3)


def test_floor_uses_what_was_measured() -> None:
    assert bench.floor_us(2_000_000, 10**12, {bench.COPY_BW: 2e12}) == (1.0, "bytes")
    assert bench.floor_us(2_000_000, 10**12, {bench.MATMUL_RATE: 1e15}) == (1000.0, "flops")
    assert bench.floor_us(2_000_000, 10**12, {bench.COPY_BW: None}) == (None, None)
    assert bench.floor_us(0, 0, FLOORS) == (None, None)
    assert bench.floor_us(10**8, 0, FLOORS, bench.D2H_BW) == (2000.0, "bytes")


def test_attention_floors_by_hand() -> None:
    # 8B decode, one sequence of 4096 keys: K and V of 8 heads x 128, q and out of 32 x 128.
    assert bench.attention_bytes(LLAMA_8B, 1, 1, 4096) == 2 * (4096 * 2 * 8 * 128 + 2 * 32 * 128)
    assert bench.attention_flops(LLAMA_8B, 1, 1, 4096) == 4 * 4096 * 32 * 128
    assert bench.attention_bytes(LLAMA_8B, 64, 1, 512) == 64 * bench.attention_bytes(LLAMA_8B, 1, 1, 512)  # fmt: skip
    # a causal 2048-token prefill: half of the full square
    assert bench.attention_flops(LLAMA_8B, 1, 2048, 2048) == 4 * 2048 * 2048 * 32 * 128 // 2
    assert bench.attention_bytes(LLAMA_8B, 1, 2048, 2048) == 2 * (2048 * 2 * 8 * 128 + 2 * 2048 * 32 * 128)  # fmt: skip
    assert bench.attention_flops(SMOLLM2, 2, 1, 512) == 2 * 4 * 512 * 9 * 64


def test_attention_cases() -> None:
    cases = bench.attention_cases()
    assert len(cases) == 7
    assert cases[0] == ("decode B=1 ctx=512", 1, 1, 512)
    assert ("decode B=64 ctx=4096", 64, 1, 4096) in cases
    assert cases[-1] == ("prefill 2048 causal", 1, 2048, 2048)


def test_the_longer_plans_walk_fewer_pages_a_cta_at_4k_keys() -> None:
    """`paged attn tc plan4k` and `plan8k`'s geometry, against the default's, at batch 1
    on Llama-3.1-8B's 8 KV heads of 4 query heads (a table 128k keys wide, 32-key pages):
    the CTAs and the chunks of a 4,096-key context each walks; batch 16 and 64 alike. The
    planned context is put back afterwards, even when the block raises."""
    from reprise.cuda import attention_kernel as ak
    from reprise.cuda.attention_tc_kernel import ROWS_PER_CTA as TC_ROWS

    def grid(batch: int, plan: int | None) -> ak.SplitGrid:
        with bench.planned_context(plan):
            return ak.split_grid(batch, batch, 8, 4, 131072 // 32, 32, TC_ROWS)

    chunks = 4096 // ak.KV_CHUNK
    cases = [(None, 4, 8, 2, 64), (bench.PLANS["plan4k"], 2, 16, 1, 32),
             (bench.PLANS["plan8k"], 1, 33, 1, 16)]  # fmt: skip
    for plan, parts, lanes, chunks_a_cta, busy_at_512 in cases:
        got = grid(1, plan)
        assert (got.head_parts, got.kv_lanes) == (parts, lanes), plan
        assert -(-chunks // got.kv_lanes) == chunks_a_cta, plan
        assert got.busy_ctas(512) == busy_at_512, plan
        assert all(grid(b, plan) == grid(b, None) for b in (16, 64)), plan
    assert grid(1, bench.PLANS["plan8k"]).busy_ctas(4096) == 128
    before = ak.PLANNED_CONTEXT
    with pytest.raises(RuntimeError), bench.planned_context(bench.PLANS["plan4k"]):
        raise RuntimeError
    assert before == ak.PLANNED_CONTEXT


def test_the_baseline_builds_name_the_kernels_defines_and_are_put_back(monkeypatch) -> None:
    """`paged attn tc expf`, `tc sel`, `tc coop` and the ablations `tc notail` and `tc
    nomath` (BUILDS) compile attention_tc.cu with defines it declares (an unknown name
    would build the default silently; the ablation's values 1 and 2, the others' 1), each a
    different build;
    the launcher's BUILD is theirs during the call and () again after it, even when the
    call raises."""
    from reprise.cuda import attention_tc_kernel as tc

    source = nvrtc.kernel_source(Path(__file__).parents[1] / "cuda" / "attention_tc.cu")
    for build in bench.BUILDS.values():
        for define in build:
            name, _, value = define.partition("=")
            values = ("1", "2") if name == "REPRISE_ATTN_ABLATE" else ("1",)
            assert f"#ifndef {name}\n#define {name} 0\n" in source and value in values, define
    assert len(set(bench.BUILDS.values())) == len(bench.BUILDS) and () not in bench.BUILDS.values()
    seen = []

    def launcher(**inputs):
        seen.append((tc.BUILD, inputs))
        if inputs.get("fail"):
            raise RuntimeError

    monkeypatch.setattr(tc, "paged_attention_tc", launcher)
    for build in bench.BUILDS.values():
        bench.paged_attention_tc_built(build, q="q")
        with pytest.raises(RuntimeError):
            bench.paged_attention_tc_built(build, fail=True)
        assert tc.BUILD == ()
    assert [b for b, _ in seen] == [b for b in bench.BUILDS.values() for _ in range(2)]
    assert seen[0][1] == {"q": "q"}



def test_the_shorter_chunks_split_a_short_decode_finer_and_are_put_back(monkeypatch) -> None:
    """`paged attn tc chunk64` / `chunk128` (CHUNKS) build attention_tc.cu with a chunk it
    declares (REPRISE_KV_CHUNK, 256 by default) and plan the launch for it: at batch 1 on
    Llama-3.1-8B's 8 KV heads of 4 (32-key pages, a 128k-key table) a 512-key decode has
    64 busy CTAs in each, walking 8 pages one after another for 1 query head at 256 keys a
    chunk, 4 pages for 2 heads at 128 and 2 for all 4 at 64 (the head split, planned for
    2,048 keys, needs fewer parts when there are more chunks); the workspace is the
    launcher's own (sized for the chunks), and the build and the chunk are put back after
    the call, even when it raises."""
    from reprise.cuda import attention_kernel as ak
    from reprise.cuda import attention_tc_kernel as tc

    source = nvrtc.kernel_source(Path(__file__).parents[1] / "cuda" / "attention_tc.cu")
    assert "#ifndef REPRISE_KV_CHUNK\n#define REPRISE_KV_CHUNK 256\n" in source
    assert ak.KV_CHUNK == 256
    cases = [(None, 4, 8), (bench.CHUNKS["chunk128"], 2, 4), (bench.CHUNKS["chunk64"], 1, 2)]
    for keys, parts, pages in cases:
        with bench.kv_chunk(keys):
            grid = ak.split_grid(1, 1, 8, 4, 131072 // 32, 32, tc.ROWS_PER_CTA)
            assert (grid.busy_ctas(512), grid.head_parts, ak.KV_CHUNK // 32) == (64, parts, pages)
    seen = []

    def launcher(**inputs):
        seen.append((tc.BUILD, ak.KV_CHUNK, inputs))
        if inputs.get("fail"):
            raise RuntimeError

    monkeypatch.setattr(tc, "paged_attention_tc", launcher)
    for keys in bench.CHUNKS.values():
        bench.paged_attention_tc_chunked(keys, q="q", workspace="preallocated")
        with pytest.raises(RuntimeError):
            bench.paged_attention_tc_chunked(keys, fail=True)
        assert (tc.BUILD, ak.KV_CHUNK) == ((), 256)
    want = [((f"REPRISE_KV_CHUNK={k}",), k) for k in bench.CHUNKS.values() for _ in range(2)]
    assert [(b, k) for b, k, _ in seen] == want
    assert seen[0][2] == {"q": "q", "workspace": None}

def test_small_kernel_bytes_by_hand() -> None:
    t, h = 64, 4096
    got = bench.small_kernel_bytes(LLAMA_8B, t)
    assert got["rmsnorm"] == 4 * t * h + 2 * t * h + 2 * h  # fp32 in, BF16 out, weight
    assert got["add_rmsnorm"] == (4 + 2 + 4 + 2) * t * h + 2 * h
    assert got["embed"] == 4 * t + (2 + 4) * t * h
    assert got["silu_mul"] == (2 * 2 + 2) * t * 14336
    assert got["kv_write"] == 2 * 2 * (t * 8 * 128 * 2) + 8 * t
    assert got["rope q+k"] == 4 * t * (32 + 8) * 128 + 2 * (4 * t + 4 * t * 128)
    # one launch for the three: q, k, v read once, q and k (rotated) and v written once
    assert got["rope_kv_write"] == 2 * 2 * t * (32 + 16) * 128 + 8 * t + 4 * t + 4 * t * 128
    assert bench.small_kernel_bytes(LLAMA_8B, 1)["argmax"] == 4 * 128256 + 4


def test_kv_block_of_llama_8b_is_4_mib() -> None:
    assert bench.kv_block_bytes(LLAMA_8B, 32) == 32 * 2 * 8 * 32 * 128 * 2 == 4 << 20


def test_overlap_fraction() -> None:
    assert bench.overlap_fraction(100.0, 40.0, 100.0) == 1.0  # copies wholly hidden
    assert bench.overlap_fraction(100.0, 40.0, 140.0) == 0.0  # one after the other
    assert bench.overlap_fraction(100.0, 40.0, 120.0) == 0.5


def test_ratio() -> None:
    assert bench.ratio(3.0, 2.0) == 1.5
    assert bench.ratio(None, 2.0) is None
    assert bench.ratio(3.0, None) is None
    assert bench.ratio(3.0, 0.0) is None


def test_bf16_bits_round_like_ml_dtypes(rng: np.random.Generator) -> None:
    x = rng.standard_normal(10_000).astype(np.float32) * np.exp2(rng.integers(-60, 60, 10_000))
    ties = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x3F807FFF, 0x7F7FFFFF, 0], np.uint32)
    x = np.concatenate([x.astype(np.float32), ties.view(np.float32)])
    expected = x.astype(BF16).view(np.uint16)
    np.testing.assert_array_equal(bench.bf16_bits(x), expected)
    assert bench.bf16_bits(ties.view(np.float32))[:3].tolist() == [0x3F80, 0x3F82, 0xBF80]


def test_parse_sections() -> None:
    assert bench.parse_sections("all") == bench.SECTION_NAMES
    assert bench.parse_sections("none") == ()
    assert bench.parse_sections("hosttier, gemm") == ("floors", "gemm", "hosttier")
    assert bench.parse_sections("floors") == ("floors",)
    with pytest.raises(argparse.ArgumentTypeError, match="unknown section gemv"):
        bench.parse_sections("gemm,gemv")


def test_row_and_table() -> None:
    row = bench.make_row(
        ("gemm", "llama-3.1-8b", "qkv", "M=1 N=6144 K=4096"), (40.0, None), FLOORS,
        cost=(2_000_000, 0), ref=("cuBLAS bf16 out", 20.0, None), extra=1,
    )  # fmt: skip
    assert row["floor_us"] == 1.0 and row["bound"] == "bytes"
    assert row["x_floor"] == 40.0 and row["x_ref"] == 2.0 and row["extra"] == 1
    failed = bench.make_row(("small", "m", "rope q+k", "T=1"), (None, "ValueError: bad"), {})
    assert failed["time_us"] is failed["floor_us"] is failed["x_floor"] is None
    header, line, bad = bench.format_header(), bench.format_row(row), bench.format_row(failed)
    assert len(line) == len(header) == len(bad.split("  error")[0])
    assert line.split()[-6:] == ["40.00", "1.00", "bytes", "40.00", "20.00", "2.00"]
    assert bad.endswith("error: ValueError: bad") and " - " in bad
    json.dumps([row, failed])  # the rows go into the JSON as they are


def test_main_without_a_device_says_so(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(bench, "cuda_device_available", lambda: False)
    out = tmp_path / "r.json"
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--out", str(out)])
    assert "no CUDA device" in str(exit_info.value.code)
    assert not out.exists()


def test_bad_arguments_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--models", "gpt-2"], ["--iters", "0"], ["--sections", "gemv"]):
        with pytest.raises(SystemExit) as exit_info:
            bench.main(argv)
        assert exit_info.value.code == 2
    assert "gpt-2" in capsys.readouterr().err


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120
    )


def test_sections_none_writes_empty_results(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    done = run_script("--sections", "none", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "nothing measured" in done.stdout
    results = json.loads(out.read_text())
    assert results["command"] == f"python bench/bench_gpu_kernels.py --sections none --out {out}"
    assert results["rows"] == results["errors"] == [] and results["floors"] == {}
    assert {"device", "date", "settings"} <= results.keys()


@pytest.mark.skipif(cuda_device_available(), reason="here a device would run the benchmark")
def test_script_without_a_device_exits_cleanly(tmp_path: Path) -> None:
    done = run_script("--out", str(tmp_path / "r.json"))
    assert done.returncode == 1
    assert "no CUDA device" in done.stderr and "Traceback" not in done.stderr


def test_module_imports_without_cupy_or_torch() -> None:
    code = (
        "import sys; import reprise.bench.bench_gpu_kernels; "
        "print(sorted({'cupy', 'cupyx', 'torch'} & set(sys.modules)))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


@pytest.mark.kernels
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_spin_kernel_compiles(arch: str) -> None:
    from reprise.cuda import nvrtc

    try:
        compiled = nvrtc.compile_source(bench.SPIN_SOURCE, "spin.cu", arch)
    except nvrtc.NvrtcUnavailable as e:
        pytest.skip(str(e))
    assert compiled.cubin[:4] == b"\x7fELF"


def test_stream_rates_by_hand() -> None:
    """3 GB in 1 ms is 3,000 GB/s, 0.75 of a 4,000 GB/s copy; no time or no floor: None."""
    rates = bench.stream_rates(3_000_000_000, 1000.0, {bench.COPY_BW: 4e12})
    assert rates == {"gb_per_s": 3000.0, "of_copy_bw": 0.75, "note": "3000 GB/s = 75.0 % of copy"}
    assert bench.stream_rates(3_000_000_000, None, {bench.COPY_BW: 4e12})["of_copy_bw"] is None
    assert bench.stream_rates(3_000_000_000, 1000.0, {})["of_copy_bw"] is None


def test_the_host_tier_rows_issue_the_same_copies_a_call_a_block_and_as_one_run() -> None:
    """`hosttier`'s `offload` / `onboard` rows issue a call a block, its `offload run` /
    `onboard run` rows the same copies (block b to slot i and back) in one tier_copies."""
    calls: list[tuple] = []

    class Backend:
        def offload_block(self, cache, block_id, host, slot):
            calls.append(("offload", block_id, slot))

        def onboard_block(self, host, slot, cache, block_id):
            calls.append(("onboard", slot, block_id))

        def tier_copies(self, cache, host, copies):
            calls.append(("run", list(copies)))

    block_ids = np.array([5, 2, 7])
    for offload in (True, False):
        calls.clear()
        bench.issue_copies(Backend(), offload, "cache", "host", block_ids)
        one_by_one = list(calls)
        calls.clear()
        bench.issue_run(Backend(), offload, "cache", "host", block_ids)
        assert calls == [("run", one_by_one)]
        kind = "offload" if offload else "onboard"
        assert [c[0] for c in one_by_one] == [kind] * 3
