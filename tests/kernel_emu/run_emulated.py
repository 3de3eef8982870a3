"""Run a script on the emulated CuPy: a dry run of GPU code on a machine without one.

    python tests/kernel_emu/run_emulated.py bench/bench_gpu_e2e.py --like emulated \\
        --block-size 16 --context 48 --batches 1,4 --prefill-tokens 64 --ttft-tokens 96

builds the kernel emulation (g++), installs emucupy as `cupy`, adds synthetic shapes
to daemon/model/synth.py's SHAPES, and runs the script as `__main__`: "emulated" (the one
tests/test_cupy_emulated.py uses: head dim 64, 2 layers) and "emulated-deep" (its
width with Llama-3.1-8B's 32 layers, vocabulary and context). What it measures is the
emulation's speed, which says nothing of a GPU's; what it shows is whether the
script's own code runs, and how many kernels each step launches. Sections that need
torch on CUDA fail (the scripts record such failures and go on).

    python tests/kernel_emu/run_emulated.py --skip-kernels bench/bench_gpu_e2e.py \\
        --like emulated-deep --sections decode --batches 1,64,256 --context 1024

launches no kernel at all (each launch is counted, and memory the kernels would
have written reads as zeros): what an engine step then takes is its CPU side alone
(scheduling, the inputs, the launches or the replay, the readback, bookkeeping), the
part a GPU step cannot hide. Its figures are this CPU's, with NumPy arrays standing in
for CuPy's, whose calls cost a few microseconds more each.
"""

from __future__ import annotations

import runpy
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def main() -> None:
    args = sys.argv[1:]
    skip = "--skip-kernels" in args[:1]
    args = args[skip:]
    if not args:
        sys.exit(__doc__)
    sys.path[:0] = [str(TESTS), str(Path(args[0]).resolve().parent)]
    from conftest import build_emulation
    from kernel_emu import emucupy
    from test_cupy_emulated import SHAPE

    from reprise.daemon.model import synth

    emucupy.install(build_emulation(Path(tempfile.mkdtemp(prefix="reprise-emu-"))),
                    lambda mapping, key, value: mapping.__setitem__(key, value))  # fmt: skip
    emucupy.skip_kernels(skip)
    synth.SHAPES["emulated"] = SHAPE
    llama = synth.SHAPES["llama-3.1-8b"]
    synth.SHAPES["emulated-deep"] = {
        **SHAPE,
        **{k: llama[k] for k in ("num_hidden_layers", "vocab_size", "max_position_embeddings")},
    }
    sys.argv = args
    runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    main()
