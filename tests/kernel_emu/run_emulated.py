"""Run a script on the emulated CuPy: a dry run of GPU code on a machine without one.

    python tests/kernel_emu/run_emulated.py bench/bench_gpu_e2e.py --like emulated \\
        --block-size 16 --context 48 --batches 1,4 --prefill-tokens 64 --ttft-tokens 96

builds the kernel emulation (g++), installs emucupy as `cupy`, adds a synthetic shape
"emulated" (the one tests/test_cupy_emulated.py uses: head dim 64, 2 layers) to
daemon/synth.py's SHAPES, and runs the script as `__main__`. What it measures is the
emulation's speed, which says nothing of a GPU's; what it shows is whether the
script's own code runs, and how many kernels each step launches. Sections that need
torch on CUDA fail (the scripts record such failures and go on).
"""

from __future__ import annotations

import runpy
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    sys.path[:0] = [str(TESTS), str(Path(sys.argv[1]).resolve().parent)]
    from conftest import build_emulation
    from kernel_emu import emucupy
    from test_cupy_emulated import SHAPE

    from reprise.daemon import synth

    emucupy.install(build_emulation(Path(tempfile.mkdtemp(prefix="reprise-emu-"))),
                    lambda mapping, key, value: mapping.__setitem__(key, value))  # fmt: skip
    synth.SHAPES["emulated"] = SHAPE
    script, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
