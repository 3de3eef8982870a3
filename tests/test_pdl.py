"""Programmatic dependent launch (cuda/pdl.py), what can be checked without a GPU: every
kernel enters through `pdl_enter()` first, the driver structures match cuda.h, the
arguments are packed as the driver takes them, and the switch is read strictly. The
engine's launches through it run in the kernel emulator
(tests/test_cupy_emulated.py::test_programmatic_dependent_launch_keeps_every_bit); on a
GPU, tests/test_invariance.py and bench_gpu_e2e.py run with REPRISE_PDL=1
(scripts/gpu_pdl.sh) and with the default, `graphs`."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from reprise.cuda import pdl
from reprise.cuda.families import FAMILIES
from reprise.cuda.nvrtc import include_dir, kernel_names

ENTRY = re.compile(r'extern\s+"C"\s+__global__\s[^{;]*\{')  # up to the body's brace


# The warp-specialized Hopper GEMM's entry points call pdl_enter() inside the tile
# function, after its weight prologue (WEIGHT_PROLOGUE below).
WEIGHT_PROLOGUE_BODIES = (
    "GEMM_SM90_WS_BODY(",
    "GEMM_SM90_WS_SPLIT_BODY(",
    "GEMM_SM90_WS_GATED_SPLIT_BODY(",
    "GEMM_SM90_WS_C2_BODY(",
    "GEMM_SM90_WS_CSPLIT_BODY(",
    "GEMM_SM90_WS_NORM_BODY(",
    "GEMM_SM90_WS_NORM_SPLIT_BODY(",
    "GEMM_SM90_WS_ROPE_BODY(",
    "GEMM_SM90_WS_ROPE_SPLIT_BODY(",
)


# The tensor-core attention kernel's entry points call pdl_enter() inside the kernel, after
# its metadata and the KV pages no running grid writes (test_only_old_pages_...).
ATTENTION_PROLOGUE_BODIES = ("paged_attention_tc<",)
# The persistent layer tail's entry points (decode_block.cu) build their arguments, then
# decode_tail loads its first weight words before its pdl_enter(), and decode_layers calls
# it first (test_the_persistent_tail_reads_only_its_weight_before_the_wait).
TAIL_PROLOGUE_BODIES = ("const Tail tail DECODE_TAIL_TAIL;",)
TAIL_DECLARED = ["const Tail tail DECODE_TAIL_TAIL;", "const NextHead head DECODE_TAIL_HEAD;"]
LAYER_DECLARED = [
    "const Tail tail DECODE_TAIL_TAIL;",
    "const NextHead head DECODE_LAYER_HEAD;",
    "const AttnArgs attention DECODE_LAYER_ATTENTION;",
]
# Entry points that read their metadata before pdl_enter() in their own body (checked by
# test_rope_kv_write_reads_only_its_place_before_the_wait).
EARLY_METADATA_KERNELS = ("rope_kv_write",)


def test_the_weight_prologue_bodies_are_the_warp_specialized_tile() -> None:
    """Each body the check below lets stand for pdl_enter() expands to gemm_sm90_ws_tile
    (which waits after its weight prologue) where the kernels are built, and traps elsewhere."""
    source = (Path(pdl.__file__).parent / "gemm_sm90.cu").read_text()
    for body in WEIGHT_PROLOGUE_BODIES:
        macro = body.removesuffix("(")
        definitions = re.findall(rf"#define {macro}\([^)]*\)\s*\\?\s*\n?\s*(.+)", source)
        assert len(definitions) == 2, (macro, definitions)  # built, and the __trap() stand-in
        assert definitions[0].startswith("gemm_sm90_ws_tile<"), (macro, definitions[0])
        assert definitions[1].startswith("__trap()"), (macro, definitions[1])


def test_every_kernel_enters_through_pdl_first() -> None:
    """The first statement of every `__global__` entry point is `pdl_enter();` (or the
    warp-specialized GEMM's body, which calls it after its weight prologue): a kernel
    launched early must wait before it touches global memory."""
    names = []
    for family in FAMILIES:
        source = family.source.read_text()
        entries = list(ENTRY.finditer(source))
        assert entries, f"no kernel found in {family.source.name}"
        entry_names = kernel_names(source)
        assert len(entry_names) == len(entries), family.source.name
        for name, entry in zip(entry_names, entries, strict=True):
            body = source[entry.end() :].lstrip()
            if name in EARLY_METADATA_KERNELS:
                names.append(name)
                continue
            firsts = ("pdl_enter();", *WEIGHT_PROLOGUE_BODIES, *ATTENTION_PROLOGUE_BODIES)
            assert body.startswith((*firsts, *TAIL_PROLOGUE_BODIES)), (
                f"{family.source.name}: {name} does not call pdl_enter() first"
            )
            names.append(name)
    assert len(names) == len(set(names)) >= 50, names


def test_the_persistent_tail_reads_only_its_weight_before_the_wait() -> None:
    """decode_block.cu: each entry point's body, before its call, only builds its
    arguments (the tail's, its head's, and decode_layer's, its attention's); decode_tail,
    before its one pdl_enter(), only loads the first round of o_proj's weight words
    (o_proj of its parameters, first_batch, load_batch: __ldg or ldg_evict_first of the
    weight's rows alone, a constant no grid writes); decode_layers calls pdl_enter() first."""
    source = (Path(pdl.__file__).parent / "decode_block.cu").read_text()

    def body_of(signature: str) -> str:
        text = source[source.index(signature) :]
        return text[text.index("{") : text.index("\n}\n")]

    for entry in ENTRY.finditer(source):
        body = source[entry.end() : source.index("\n}\n", entry.end())]
        assert body.lstrip().startswith(TAIL_PROLOGUE_BODIES), body[:80]
        call = "decode_tail<" if "decode_tail<" in body else "decode_layers<"
        declared = [line.strip() for line in body[: body.index(call)].strip().splitlines()]
        assert declared == (TAIL_DECLARED if call == "decode_tail<" else LAYER_DECLARED), declared
    tail = body_of("void decode_tail(")
    assert tail.count("pdl_enter();") == 1
    before = tail[: tail.index("pdl_enter();")]
    assert before.strip("{ \n") == "const Batch next = first_batch<PACKED, true>(o_proj(t, w));", (
        before
    )
    o_proj = body_of("Projection o_proj(")
    assert o_proj.strip("{ \n") == "return {matrix(w, kO), t.y_o, t.hidden, t.q_size, t.split_o};"
    one_line = "const void* weight_of(const ParamWeights& w, Weight i) { return w.w[i]; }"
    assert one_line in source  # the tail's weights: its launch's parameters
    assert body_of("void decode_layers(").strip("{ \n").startswith("pdl_enter();")
    loads = body_of("void load_batch(") + body_of("Batch first_batch(")
    assert loads.count("__ldg(") == 1 and loads.count("ldg_evict_first(") == 1
    assert "weight_row<PACKED>(p.w," in loads
    for touch in ("__ldcg", "p.y", "atomic", "x[", "= *"):
        assert touch not in loads, touch


def test_only_the_weight_comes_before_the_wait_in_the_warp_specialized_gemm() -> None:
    """Before its pdl_enter(), gemm_sm90_ws_tile initialises its barriers and starts the
    first stages' weight copies into shared memory (the packed weight is constant): no
    read of x, no write of y, the workspace or the counters; then every thread waits."""
    source = (Path(pdl.__file__).parent / "gemm_sm90.cu").read_text()
    body = source[source.index("void gemm_sm90_ws_tile(") :]
    body = body[body.index("{") : body.index("\n}\n")]
    assert body.count("pdl_enter();") == 1
    before = body[: body.index("pdl_enter();")]
    assert "issue_weight(t)" in before and "mbar_init(" in before
    for touch in ("ws_x_source(", "cp_async_16(", "y[", "out[", "counters[", "atomic",
                  "fold_split_partials"):  # fmt: skip
        assert touch not in before, touch
    call = before[before.rindex("issue_weight(t)") - 80 :]
    assert "if (tid == 0)" in call  # one thread issues them, not a branch others skip past
    for macro in (
        "GEMM_SM90_WS_BODY(TILE, MODE, Y, OUT, SPLIT_LEN)",
        "GEMM_SM90_WS_SPLIT_BODY(TILE)",
    ):
        enabled = source[source.index(f"#define {macro}") :].split("\n", 2)
        assert "gemm_sm90_ws_tile<" in "".join(enabled[:2]), macro


def test_only_metadata_and_old_pages_come_before_the_wait_in_tensor_core_attention() -> None:
    """Before paged_attention_tc's pdl_enter(): the metadata, the block table and the
    ring's first pages, each only while it lies wholly before the sequence's first query
    position; no read of q, no write of out, the workspace or the counters. Every return
    before the wait waits first, and the rest of the ring's prologue comes after it."""
    source = (Path(pdl.__file__).parent / "attention_tc.cuh").read_text()
    body = source[source.index("void paged_attention_tc(") :]
    body = body[body.index("{") : body.index("\n}\n")]
    waits = [i for i in range(len(body)) if body.startswith("pdl_enter();", i)]
    assert len(waits) == 4, len(waits)  # three early returns, then the wait
    for at in waits[:3]:
        assert body[at:].split("\n", 2)[1].strip().startswith("return;")
    before, after = body[: waits[-1]], body[waits[-1] :]
    assert before.count("return;") == 3
    guard = "(page_of(early) + 1) * BLOCK_SIZE > first_query_pos) break;"
    assert before.index(guard) < before.index("issue(early, ")
    assert "const int first_query_pos = seq_len - q_len;" in before
    code = re.sub(r"//[^\n]*", "", before)  # what the comments name does not count
    for touch in (r"\bq\s*[+\[]", r"\bout\b", r"\bworkspace\b", r"\bws_ml\b", r"\bcounters?\b",
                  r"\batomic", r"\btotal\("):  # fmt: skip
        assert not re.search(touch, code), touch
    # the ring starts at page k0 (the first page the CTA's first row's window reaches)
    assert "qf[ds][e] = " in after and "for (int k = early; k < k0 + C::kStages - 1; ++k)" in after


def test_rope_kv_write_reads_only_its_place_before_the_wait() -> None:
    """kvcache.cu's rope_kv_write: before its pdl_enter() only rope_kv_place (the rotation
    and cache row from positions, slots and the tables), no row of qkv and no write; a
    thread past the pairs waits before it returns; and rope_kv_place reads nothing else."""
    source = (Path(pdl.__file__).parent / "kvcache.cu").read_text()
    body = source[source.index("void rope_kv_write(") :]
    body = body[body.index("{") : body.index("\n}\n")]
    code = re.sub(r"//[^\n]*", "", body)
    waits = [m.start() for m in re.finditer(r"pdl_enter\(\);", code)]
    assert len(waits) == 2 and code[waits[0] :].split("\n", 2)[1].strip() == "return;"
    before = code[: waits[1]]
    assert "rope_kv_place(" in before
    before = re.sub(r"const RopeKvArgs args\{[^}]*\};", "", before)  # pointers named, not read
    for touch in (r"\bqkv\b", r"\bq_out\b", r"\bcache\b\s*\[", r"rope_kv_write_at", r"\[.*\]\s*="):
        assert not re.search(touch, before), touch
    assert "rope_kv_write_at<false>(qkv" in code[waits[1] :]
    header = (Path(pdl.__file__).parent / "kvcache.cuh").read_text()
    place = header[header.index("RopeKvPlace rope_kv_place(") :]
    place = place[: place.index("\n}\n")]
    for touch in ("qkv", "q_out", "a.cache", "bf16_at"):
        assert touch not in place, touch


def test_pdl_enter_waits_then_lets_the_next_grid_launch_on_sm90_only() -> None:
    common = (Path(pdl.__file__).parent / "common.cuh").read_text()
    body = common[common.index("void pdl_enter()") :]
    body = body[: body.index("\n}\n")]
    assert "__CUDA_ARCH__ >= 900" in body
    assert body.index("griddepcontrol.wait") < body.index("griddepcontrol.launch_dependents")


@pytest.mark.parametrize(
    ("value", "mode"),
    [(None, "graphs"), ("graphs", "graphs"), ("0", "0"), ("1", "1")],
    ids=["unset", "graphs", "0", "1"],
)
def test_the_switch(value: str | None, mode: str) -> None:
    assert pdl.requested({} if value is None else {pdl.ENV: value}) == mode


@pytest.mark.parametrize("value", ["yes", "", "2", "true", "Graphs"])
def test_a_bad_switch_is_refused_in_one_line(value: str) -> None:
    with pytest.raises(ValueError, match=r"^REPRISE_PDL must be graphs \(launches captured"):
        pdl.requested({pdl.ENV: value})


@pytest.mark.parametrize(
    ("mode", "eager", "captured"),
    [("graphs", False, True), ("1", True, True), ("0", False, False)],
)
def test_which_launches_are_dependents(monkeypatch: pytest.MonkeyPatch, mode: str, eager: bool,
                                       captured: bool) -> None:  # fmt: skip
    """Mode `graphs`: only launches inside `capturing()` (CupyBackend.capture's captured
    run); `1`: every launch; `0`: none. Leaving `capturing()`, even by an exception,
    ends it."""
    monkeypatch.setattr(pdl, "active", lambda: mode)
    assert pdl.dependent() is eager
    with pdl.capturing():
        assert pdl.dependent() is captured
    assert pdl.dependent() is eager
    with pytest.raises(RuntimeError), pdl.capturing():
        raise RuntimeError("a failed capture")
    assert pdl.dependent() is eager


class FakeDeviceArray:
    """What pack_args reads of a CuPy array: `.data.ptr`."""

    def __init__(self, ptr: int) -> None:
        self.data = type("Pointer", (), {"ptr": ptr})()


def test_arguments_are_packed_as_the_driver_reads_them() -> None:
    args = (FakeDeviceArray(0xDEAD0000), np.int32(-7), np.float32(0.5), np.int64(1 << 40),
            FakeDeviceArray(0x1000))  # fmt: skip
    pointers, keep = pdl.pack_args(args)
    assert len(keep) == len(args)

    def at(i: int, ctype):
        return ctypes.cast(pointers[i], ctypes.POINTER(ctype)).contents.value

    assert at(0, ctypes.c_void_p) == 0xDEAD0000 and at(4, ctypes.c_void_p) == 0x1000
    assert at(1, ctypes.c_int32) == -7 and at(2, ctypes.c_float) == 0.5
    assert at(3, ctypes.c_int64) == 1 << 40


@pytest.mark.parametrize("bad", [3, 0.5, np.zeros(2, np.int32)], ids=["int", "float", "host"])
def test_a_python_number_or_host_array_is_refused(bad) -> None:
    with pytest.raises(TypeError, match="kernel argument 1: pass a device array or a NumPy"):
        pdl.pack_args((FakeDeviceArray(1), bad))


def test_the_launch_config_asks_for_programmatic_serialization() -> None:
    config, attrs = pdl.launch_config((132, 2), (128,), 4096, 0x1234)
    got = (config.gridDimX, config.gridDimY, config.gridDimZ, config.blockDimX,
           config.blockDimY, config.blockDimZ, config.sharedMemBytes, config.hStream)  # fmt: skip
    assert got == (132, 2, 1, 128, 1, 1, 4096, 0x1234)
    assert config.numAttrs == 1 and ctypes.addressof(config.attrs.contents) == ctypes.addressof(
        attrs
    )
    assert attrs[0].id == 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert int.from_bytes(bytes(attrs[0])[8:12], "little") == 1
    with pytest.raises(ValueError, match="1 to 3 positive dimensions"):
        pdl.launch_config((0,), (128,), 0, 0)


def test_the_launch_config_asks_for_clusters_when_told() -> None:
    """A cluster launch (gemm_sm90.cu's cluster split) carries the cluster-dimension
    attribute, x = the CTAs a cluster, with or without programmatic serialization; a grid
    that is not whole clusters is refused."""
    for programmatic in (True, False):
        config, attrs = pdl.launch_config((12, 5), (256,), 0, 0, programmatic=programmatic,
                                          cluster=4)  # fmt: skip
        assert config.numAttrs == 1 + programmatic
        cluster = attrs[int(programmatic)]
        assert cluster.id == 4  # CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        dims = bytes(cluster)[8:20]
        assert [int.from_bytes(dims[i : i + 4], "little") for i in (0, 4, 8)] == [4, 1, 1]
        assert ctypes.addressof(config.attrs.contents) == ctypes.addressof(attrs)
    config, _ = pdl.launch_config((12, 5), (256,), 0, 0, programmatic=False)
    assert config.numAttrs == 0
    with pytest.raises(ValueError, match="whole clusters of 4"):
        pdl.launch_config((10, 5), (256,), 0, 0, cluster=4)


def test_the_launch_config_asks_for_a_cooperative_launch_when_told() -> None:
    """decode_block.cu's persistent launch carries the cooperative attribute (value 1: the
    driver runs every CTA at once or refuses the launch), with or without programmatic
    serialization, beside it."""
    for programmatic in (True, False):
        config, attrs = pdl.launch_config((132,), (256,), 0, 0, programmatic=programmatic,
                                          cooperative=True)  # fmt: skip
        assert config.numAttrs == 1 + programmatic
        assert [attrs[i].id for i in range(config.numAttrs)] == [2, 6][: 1 + programmatic]
        assert int.from_bytes(bytes(attrs[0])[8:12], "little") == 1


def test_a_refused_cooperative_dependent_launches_cooperative_alone(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A driver that refuses a cooperative launch that is also a programmatic dependent
    (CUDA does not say it may; if it does, the persistent layer's first GPU run would be
    lost): that launch is retried cooperative alone, one warning says so, and every later
    one goes so at once; other launches keep their attributes. A refusal of the retry, or
    of any other launch, is raised."""
    calls: list[tuple[bool, bool]] = []

    class Refusing:
        refuse_alone = False

        def launch(self, fn, grid, block, args, shared_mem, *, programmatic=True, cluster=1,
                   cooperative=False):  # type: ignore[no-untyped-def]  # fmt: skip
            calls.append((programmatic, cooperative))
            if cooperative and (programmatic or self.refuse_alone):
                raise RuntimeError("cuLaunchKernelEx failed: CUDA_ERROR_INVALID_VALUE (1)")

    driver = Refusing()
    monkeypatch.setattr(pdl, "_driver", driver)
    monkeypatch.setattr(pdl, "cooperative_programmatic", None)
    with caplog.at_level("WARNING", logger="reprise.cuda.pdl"):
        pdl.launch(None, (4,), (256,), (), 0, cooperative=True)
        pdl.launch(None, (4,), (256,), (), 0, cooperative=True)
        pdl.launch(None, (4,), (256,), (), 0)
    assert calls == [(True, True), (False, True), (False, True), (True, False)]
    assert pdl.cooperative_programmatic is False
    assert len([r for r in caplog.records if "refused" in r.getMessage()]) == 1
    driver.refuse_alone = True
    with pytest.raises(RuntimeError, match="INVALID_VALUE"):
        pdl.launch(None, (4,), (256,), (), 0, cooperative=True)
    monkeypatch.setattr(pdl, "cooperative_programmatic", None)
    calls.clear()
    with pytest.raises(RuntimeError, match="INVALID_VALUE"):  # the retry refused too
        pdl.launch(None, (4,), (256,), (), 0, cooperative=True)
    assert calls == [(True, True), (False, True)] and pdl.cooperative_programmatic is None


def test_a_cooperative_dependent_the_driver_takes_keeps_both_attributes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[bool, bool]] = []

    class Taking:
        def launch(self, fn, grid, block, args, shared_mem, *, programmatic=True, cluster=1,
                   cooperative=False):  # type: ignore[no-untyped-def]  # fmt: skip
            calls.append((programmatic, cooperative))

    monkeypatch.setattr(pdl, "_driver", Taking())
    monkeypatch.setattr(pdl, "cooperative_programmatic", None)
    for _ in range(2):
        pdl.launch(None, (4,), (256,), (), 0, cooperative=True)
    assert calls == [(True, True)] * 2 and pdl.cooperative_programmatic is True


def _cuda_header() -> Path | None:
    for root in (include_dir(), Path("/usr/local/cuda/include")):
        if root is not None and (root / "cuda.h").is_file():
            return root
    return None


def test_the_structures_match_cuda_h(tmp_path: Path) -> None:
    """Sizes and offsets of CUlaunchConfig and CUlaunchAttribute, and the attributes' ids
    (programmatic serialization, cluster dimension: x, y, z at the value's start;
    cooperative), as the
    C compiler lays them out from the toolkit's own cuda.h."""
    root, cc = _cuda_header(), shutil.which("cc") or shutil.which("gcc")
    if root is None or cc is None:
        pytest.skip("needs cuda.h (nvidia-cuda-runtime or a toolkit) and a C compiler")
    src = tmp_path / "layout.c"
    src.write_text(r"""
#include <stddef.h>
#include <stdio.h>
#include <cuda.h>
int main(void) {
  CUlaunchAttribute a;
  printf("%zu %zu %zu %zu %zu %zu %zu %d %d %d %zu %zu %zu\n", sizeof(CUlaunchConfig),
         sizeof(CUlaunchAttribute), offsetof(CUlaunchConfig, hStream), offsetof(CUlaunchConfig, attrs),
         offsetof(CUlaunchConfig, numAttrs), offsetof(CUlaunchAttribute, value),
         offsetof(CUlaunchConfig, sharedMemBytes),
         (int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
         (int)CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, (int)CU_LAUNCH_ATTRIBUTE_COOPERATIVE,
         (size_t)((char*)&a.value.clusterDim.x - (char*)&a.value),
         (size_t)((char*)&a.value.clusterDim.y - (char*)&a.value),
         (size_t)((char*)&a.value.clusterDim.z - (char*)&a.value));
  return 0;
}
""")
    exe = tmp_path / "layout"
    subprocess.run([cc, "-I", str(root), "-o", str(exe), str(src)], check=True)
    got = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.split()
    want = [ctypes.sizeof(pdl.LaunchConfig), ctypes.sizeof(pdl.LaunchAttribute),
            pdl.LaunchConfig.hStream.offset, pdl.LaunchConfig.attrs.offset,
            pdl.LaunchConfig.numAttrs.offset, pdl.LaunchAttribute.value.offset,
            pdl.LaunchConfig.sharedMemBytes.offset, 6, 4, 2, 0, 4, 8]  # fmt: skip
    assert list(map(int, got)) == want
