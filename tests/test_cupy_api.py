"""The real CuPy, without a device: it imports wherever reprise runs (the repository
root included), the backend says why it cannot use it, every `cupy.*` name reprise's
code and GPU tests use exists in it, and the emulated CuPy the GPU code is dry-run on
(tests/kernel_emu/emucupy.py) offers nothing it lacks and takes no call it would refuse.
CI installs CuPy (scripts/setup.sh test) for this; elsewhere the CuPy parts skip."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import logging
import os
import re
import subprocess
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kernel_emu import emucupy

from reprise.cuda import backend

ROOT = Path(__file__).resolve().parents[1]


def real_cupy() -> dict[str, types.ModuleType]:
    """CuPy itself (cupy and cupyx): a failure in CI (which installs it), a skip elsewhere
    without it."""
    module = sys.modules.get("cupy")
    if module is not None and module.__version__ == "emulated":
        pytest.skip("the emulated CuPy is installed for this run")
    if importlib.util.find_spec("cupy") is None:
        if os.environ.get("CI"):
            pytest.fail("CI installs CuPy (scripts/setup.sh test) for these checks")
        pytest.skip("needs CuPy installed (no device needed)")
    return {name: importlib.import_module(name) for name in ("cupy", "cupyx")}


def run_in_root(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`python -c code` from the repository root, where Python puts the root (and so its
    `cuda/` folder) first on sys.path, as `python -m pytest` there does."""
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"} | env
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=environ,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


# ---- the repository's cuda/ folder and NVIDIA's `cuda` namespace -------------------------


def test_the_cuda_folder_does_not_hide_the_cuda_namespace(tmp_path: Path) -> None:
    """NVIDIA's `cuda` is a namespace package (cuda.pathfinder, cuda.bindings) that
    `import cupy` needs; a portion of it elsewhere on the path stays importable."""
    (tmp_path / "cuda").mkdir()
    (tmp_path / "cuda" / "reprise_probe.py").write_text("VALUE = 17\n")
    done = run_in_root(
        "import cuda, cuda.reprise_probe as p; print(cuda.__file__); print(p.VALUE)",
        PYTHONPATH=str(tmp_path),
    )
    assert done.returncode == 0, done.stderr
    shadow, value = done.stdout.split()
    assert Path(shadow) == ROOT / "cuda" / "__init__.py", "the case under test: ours comes first"
    assert value == "17"


def test_cupy_imports_from_the_repository_root() -> None:
    real_cupy()
    done = run_in_root("import cupy, cupyx; print(cupy.__version__)")
    assert done.returncode == 0, done.stderr


# ---- why the GPU backend is not used -------------------------------------------------------


def fake_cupy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str) -> None:
    """`import cupy` finds a package made of `source`."""
    (tmp_path / "cupy").mkdir()
    (tmp_path / "cupy" / "__init__.py").write_text(source)
    for name in [n for n in sys.modules if n == "cupy" or n.startswith("cupy.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path))


def test_without_cupy_auto_runs_on_numpy_quietly(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ModuleNotFoundError
    assert backend.cuda_unavailable_reason().startswith("CuPy is not installed")
    with caplog.at_level(logging.WARNING):
        assert backend.get_backend("auto").name == "numpy"
    assert caplog.records == []
    with pytest.raises(ValueError, match="needs CuPy and a CUDA device: CuPy is not installed"):
        backend.get_backend("cupy")


def test_a_cupy_that_does_not_import_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    fake_cupy(tmp_path, monkeypatch, "from cuda.no_such_part import thing\n")
    reason = backend.cuda_unavailable_reason()
    assert reason == "CuPy is installed but does not import: No module named 'cuda.no_such_part'"
    with caplog.at_level(logging.WARNING, logger="reprise"):
        assert backend.get_backend("auto").name == "numpy"
    assert [r.getMessage() for r in caplog.records] == [f"backend auto: running on NumPy; {reason}"]
    with pytest.raises(ValueError, match=r"cuda\.no_such_part"):
        backend.get_backend("cupy")


NO_DEVICE = """
class _Runtime:
    @staticmethod
    def getDeviceCount():
        {body}

class cuda:
    runtime = _Runtime
"""


@pytest.mark.parametrize(
    "body, says",
    [("return 0", "CuPy finds no CUDA device"),
     ("raise RuntimeError('cudaErrorNoDevice: no CUDA-capable device is detected')",
      "CuPy finds no CUDA device: cudaErrorNoDevice: no CUDA-capable device is detected")],
)  # fmt: skip
def test_no_device_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: str, says: str
) -> None:
    fake_cupy(tmp_path, monkeypatch, NO_DEVICE.format(body=body))
    assert backend.cuda_unavailable_reason() == says
    assert not backend.cuda_device_available()
    assert backend.get_backend("auto").name == "numpy"


# ---- the CuPy API reprise uses ---------------------------------------------------------------

SOURCE_DIRS = ["cuda", "daemon", "blockpool", "bench", "cli", "ipc"]
GPU_TESTS = ["test_gpu_attention.py", "test_gpu_gemm.py", "test_gpu_ops.py", "gpu_support.py"]


def resolve(module: types.ModuleType, chain: list[str]) -> Any:
    """module.a.b.c, importing submodules on the way (cupy.cuda.graph needs an import)."""
    obj: Any = module
    for name in chain:
        if not hasattr(obj, name) and isinstance(obj, types.ModuleType):
            importlib.import_module(f"{obj.__name__}.{name}")
        obj = getattr(obj, name)
    return obj


def used_names() -> dict[str, list[str]]:
    """Every `cupy.a.b` / `cupyx.a` chain in reprise's code, and `cp.a.b` in the GPU
    tests (whose CuPy is the `cp` fixture), with where each is used."""
    found: dict[str, list[str]] = {}
    files = [p for d in SOURCE_DIRS for p in sorted((ROOT / d).rglob("*.py"))]
    pattern = re.compile(r"(?:\b|\b_)(cupyx?)((?:\.[A-Za-z_]\w*)+)")  # self._cupy too
    cp_pattern = re.compile(r"\bcp((?:\.[A-Za-z_]\w*)+)")
    for path in files + [ROOT / "tests" / name for name in GPU_TESTS]:
        text = path.read_text()
        chains = [m.group(1) + m.group(2) for m in pattern.finditer(text)]
        if path.parent.name == "tests":
            chains += ["cupy" + m.group(1) for m in cp_pattern.finditer(text)]
        for chain in chains:
            found.setdefault(chain, []).append(str(path.relative_to(ROOT)))
    return found


def test_every_cupy_name_reprise_uses_exists() -> None:
    modules = real_cupy()
    used = used_names()
    assert {"cupy.cuda.Stream", "cupyx.empty_pinned", "cupy.cuda.runtime.memGetInfo"} <= set(used)
    missing = []
    for chain, where in sorted(used.items()):
        root, *rest = chain.split(".")
        try:
            resolve(modules[root], rest)
        except (AttributeError, ImportError) as e:
            missing.append(f"{chain} (used in {', '.join(sorted(set(where)))}): {e}")
    assert missing == [], "\n".join(missing)


# ---- the emulated CuPy against the real one -------------------------------------------------

LITERALS = (type(None), bool, int, float, str)


def only_varargs(signature: inspect.Signature) -> bool:
    """`(self, /, *args, **kwargs)`: what inspect says of a compiled class's __init__."""
    kinds = {x.kind for x in signature.parameters.values() if x.name != "self"}
    return kinds <= {inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD}


def parse_signature(fn: Any, owner: type | None = None) -> inspect.Signature | None:
    """A callable's signature; for CuPy's compiled (Cython) functions, from the
    signature their docstrings start with: `name(self, stream=None, ...)` or
    `memcpyAsync(intptr_t dst, intptr_t src, ...)`; for a compiled class's __init__
    (`owner`), from the class's docstring: `RawKernel(str code, str name, ...)`."""
    try:
        signature = inspect.signature(fn)
        if owner is None or not only_varargs(signature):
            return signature
    except (TypeError, ValueError):
        pass
    doc = (getattr(owner if owner is not None else fn, "__doc__", None) or "").strip()
    match = re.match(r"[\w.]+\((.*?)\)(\s*->[^\n]*)?(\n|$)", doc, re.DOTALL)
    if not match:
        return None
    params, kind = [], inspect.Parameter.POSITIONAL_OR_KEYWORD
    for part in filter(None, (p.strip() for p in match.group(1).split(","))):
        if part == "*":
            kind = inspect.Parameter.KEYWORD_ONLY
            continue
        if part.startswith("**"):
            params.append(inspect.Parameter(part[2:], inspect.Parameter.VAR_KEYWORD))
            continue
        if part.startswith("*"):
            params.append(inspect.Parameter(part[1:], inspect.Parameter.VAR_POSITIONAL))
            kind = inspect.Parameter.KEYWORD_ONLY
            continue
        name, _, default = (s.strip() for s in part.partition("="))
        name = name.split(":")[0].split()[-1]  # "intptr_t dst" or "dst: int"
        if not default:
            params.append(inspect.Parameter(name, kind))
            continue
        try:
            value = ast.literal_eval(default)
        except (ValueError, SyntaxError):  # a name, such as float: compared as no literal
            value = types.SimpleNamespace(source=default)
        params.append(inspect.Parameter(name, kind, default=value))
    return inspect.Signature(params)


def signature_mismatches(fake: Callable[..., Any], real: Any, what: str) -> list[str]:
    """What a call that the emulation takes would do differently on CuPy: an argument
    CuPy does not know, one at another position, one CuPy needs that the emulation does
    not ask for, or another default."""
    owner = None
    if what.endswith(".__init__"):
        owner = resolve(importlib.import_module(what.split(".")[0]), what.split(".")[1:-1])
    ours, theirs = parse_signature(fake), parse_signature(real, owner)
    if ours is None or theirs is None:
        return [f"{what}: no signature to compare ({'ours' if ours is None else 'theirs'})"]
    p = inspect.Parameter
    positional = (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    our_params = [x for x in ours.parameters.values() if x.name not in ("self", "cls")]
    their_params = [x for x in theirs.parameters.values() if x.name not in ("self", "cls")]
    their_positional = [x for x in their_params if x.kind in positional]
    their_names = {
        x.name: x for x in their_params if x.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }
    their_var_positional = any(x.kind == p.VAR_POSITIONAL for x in their_params)
    their_var_keyword = any(x.kind == p.VAR_KEYWORD for x in their_params)
    our_var_positional = any(x.kind == p.VAR_POSITIONAL for x in our_params)
    problems = []
    for i, x in enumerate(x for x in our_params if x.kind in positional):
        if i < len(their_positional):
            if x.default is not p.empty and x.name != their_positional[i].name:
                problems.append(f"{what}: argument {i} is {x.name!r} here, "
                                f"{their_positional[i].name!r} in CuPy")  # fmt: skip
        elif not their_var_positional:
            problems.append(f"{what}: CuPy takes {len(their_positional)} positional "
                            f"arguments, the emulation takes {x.name!r} as one more")  # fmt: skip
    for x in our_params:
        if x.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        theirs_x = their_names.get(x.name)
        if theirs_x is None:
            if x.kind == p.KEYWORD_ONLY and not their_var_keyword:
                problems.append(f"{what}: CuPy has no argument {x.name!r}")
            continue
        both = (x.default, theirs_x.default)
        if (
            p.empty not in both
            and all(isinstance(d, LITERALS) for d in both)
            and both[0] != both[1]
        ):
            problems.append(f"{what}: {x.name} defaults to {both[0]!r} here, {both[1]!r} in CuPy")
    for i, x in enumerate(their_positional):
        needed = x.default is p.empty
        covered = i < len([y for y in our_params if y.kind in positional]) or our_var_positional
        if needed and not covered:
            problems.append(f"{what}: CuPy needs argument {x.name!r}, the emulation does not")
    return problems


# the emulated classes and what they stand for (emucupy.Graph is what end_capture returns)
CLASSES = {"ndarray": "cupy.ndarray", "RawKernel": "cupy.RawKernel", "RawModule": "cupy.RawModule",
           "Stream": "cupy.cuda.Stream", "Event": "cupy.cuda.Event", "Graph": "cupy.cuda.graph.Graph",
           "Device": "cupy.cuda.Device", "MemoryPool": "cupy.cuda.MemoryPool",
           "MemoryPointer": "cupy.cuda.MemoryPointer", "RandomState": "cupy.random.RandomState"}  # fmt: skip
# classes whose objects CuPy makes (arrays, their memory, captured graphs) and reprise
# never constructs: the emulation's constructors are its own
MADE_BY_CUPY = {"cupy.ndarray", "cupy.cuda.MemoryPointer", "cupy.cuda.graph.Graph"}
DUNDERS = {"__init__", "__call__", "__enter__", "__exit__", "__len__", "__getitem__",
           "__setitem__", "__iter__", "__int__", "__float__", "__bool__", "__array__"}  # fmt: skip


def emulated_surface() -> dict[str, Any]:
    """Every public name the emulated CuPy offers, by its full CuPy name: module
    attributes, and the methods and properties of its classes."""
    surface: dict[str, Any] = {}
    for module_name, module in emucupy.modules().items():
        for name, value in vars(module).items():
            if name.startswith("_"):
                continue
            if isinstance(value, types.ModuleType):
                continue  # the submodules are entries of their own
            surface[f"{module_name}.{name}"] = value
            if isinstance(value, type) and value.__name__ == "_Runtime":  # cupy.cuda.runtime
                for fn_name in vars(value):
                    if not fn_name.startswith("_"):
                        surface[f"{module_name}.{name}.{fn_name}"] = getattr(value, fn_name)
    for class_name, cupy_name in CLASSES.items():
        cls = getattr(emucupy, class_name)
        surface[cupy_name] = cls
        for name, value in vars(cls).items():
            if name.startswith("_") and name not in DUNDERS:
                continue
            surface[f"{cupy_name}.{name}"] = getattr(cls, name) if callable(value) else value
    return surface


def test_the_emulation_offers_only_what_cupy_has() -> None:
    modules = real_cupy()
    surface = emulated_surface()
    assert "cupy.cuda.Stream.begin_capture" in surface and "cupy.ndarray.set" in surface
    problems = []
    for full_name, fake in sorted(surface.items()):
        root, *rest = full_name.split(".")
        try:
            real = resolve(modules[root], rest)
        except (AttributeError, ImportError):
            problems.append(f"{full_name}: the emulation has it, CuPy does not")
            continue
        if isinstance(fake, type) or not callable(fake):
            continue
        if full_name.endswith(".__init__") and full_name.rpartition(".")[0] in MADE_BY_CUPY:
            continue
        problems += signature_mismatches(fake, real, full_name)
    assert problems == [], "\n".join(problems)


def test_a_block_size_the_gpu_kernels_lack_is_refused_before_the_model_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the CuPy backend a block size the attention kernels have no entry point for
    (they stage pages of 16, 32 or 64 tokens) is a SettingError naming block_size, raised
    before the model's folder is read (here: there is none); the NumPy backend takes it."""
    from reprise.daemon import Engine
    from reprise.daemon.engine import engine as engine_module
    from reprise.daemon.engine.config import SettingError
    from reprise.daemon.model.config import ModelConfigError

    class FakeCupy:
        name = "cupy"

    monkeypatch.setattr(engine_module, "get_backend", lambda name: FakeCupy())
    missing = tmp_path / "no-model-here"
    for bs in (1, 4, 8, 128):
        with pytest.raises(
            SettingError,
            match=rf"block_size must be one of \(16, 32, 64\) on the CuPy backend.*got {bs}$",
        ) as e:
            Engine.from_pretrained(missing, backend="cupy", block_size=bs)
        assert e.value.name == "block_size"
    # a size the kernels take goes on, to the missing folder
    with pytest.raises(ModelConfigError, match=r"config\.json not found"):
        Engine.from_pretrained(missing, backend="cupy", block_size=16)
