# Sourced by the gpu_*.sh scripts: makes reprise.* importable from the source folders
# (as setup.cfg maps them) with nothing installed, and records the device in $out.
out=${OUT:-gpu-results}
mkdir -p "$out"
python=${PYTHON:-python3}
src=$(mktemp -d)
mkdir -p "$src/reprise"
for pkg in daemon cuda blockpool ipc cli bench; do ln -s "$PWD/$pkg" "$src/reprise/$pkg"; done
export PYTHONPATH="$src${PYTHONPATH:+:$PYTHONPATH}"
{
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  "$python" -c 'import cupy, numpy; print("cupy", cupy.__version__, "numpy", numpy.__version__)'
  date -u +%Y-%m-%dT%H:%M:%SZ
} 2>&1 | tee "$out/device.txt"
