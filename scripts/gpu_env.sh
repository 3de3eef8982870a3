# Sourced by the gpu_*.sh scripts: makes reprise.* importable from the source folders
# (as setup.cfg maps them) with nothing installed, and records the device in $out.
out=${OUT:-gpu-results}
mkdir -p "$out"
python=${PYTHON:-python3}
src=$(mktemp -d)
mkdir -p "$src/reprise"
for pkg in daemon cuda blockpool ipc cli bench; do ln -s "$PWD/$pkg" "$src/reprise/$pkg"; done
export PYTHONPATH="$src${PYTHONPATH:+:$PYTHONPATH}"
# one folder of compiled cubins for every part (nvrtc.cubin_file: gemm_sm90.cu for sm_90a
# compiles once a machine, not once a process)
export REPRISE_KERNEL_CACHE=${REPRISE_KERNEL_CACHE:-/tmp/reprise-kernels}
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  "$python" -c 'import cupy, numpy; print("cupy", cupy.__version__, "numpy", numpy.__version__)'
  "$python" -c 'from reprise.cuda import nvrtc; print("nvrtc", nvrtc.nvrtc_version())'
  date -u +%Y-%m-%dT%H:%M:%SZ
} 2>&1 | tee "$out/device.txt"
