# Sourced by gpu_session.sh and gpu_pdl.sh (with PACK, the archive's name): the results
# folder $top (${OUT:-gpu-results} as called), a fresh $OUT for the parts' files, and
# `part NAME SECONDS COMMAND...`, which runs a part under its own time limit (a hung or
# slow part cannot cost the others), says how it ended, and packs what is done so far
# into $top/$PACK (a lent machine sends back only a few files); with PARTS set (names
# separated by spaces), only the parts it names run; and $pytest_extra, the
# test runs' options: four processes, a file to a process, where pytest-xdist is installed
# (the GPU image has it), each test under pytest-timeout's limit where that is.
top=${OUT:-gpu-results}
mkdir -p "$top"
export OUT=$(mktemp -d)
part() {
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  if [ -n "${PARTS:-}" ] && [[ " $PARTS " != *" $name "* ]]; then
    echo "== $name: skipped (not in PARTS)"
    return 0
  fi
  timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.out" 2>&1
  local rc=$?
  echo "== $name: rc=$rc in $((SECONDS - start)) s (limit $limit s)"
  tar -czf "$top/$PACK" -C "$OUT" .  # should a later part be cut
}
pytest_extra=()
"${PYTHON:-python3}" -c "import xdist" 2>/dev/null && pytest_extra+=(-n 4 --dist loadfile)
"${PYTHON:-python3}" -c "import pytest_timeout" 2>/dev/null && pytest_extra+=(--timeout=100)
