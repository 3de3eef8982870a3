"""Device ops: for each kernel family its NumPy twin (the reference that
defines what the op computes) and, on the GPU backend, its CUDA kernel."""

import pkgutil

# Run from the repository root (`python -m pytest`, `python -c ...`), Python puts the
# root on sys.path and this folder becomes the top-level package `cuda` too, hiding
# NVIDIA's `cuda` namespace package (cuda.pathfinder, cuda.bindings), which
# `import cupy` needs: CuPy would fail to import and every GPU path would fall back to
# NumPy. Extending the path with the other `cuda` folders on sys.path keeps theirs
# importable; as `reprise.cuda` there are none, and this adds nothing.
__path__ = pkgutil.extend_path(__path__, __name__)
