#!/usr/bin/env bash
# mypy over reprise's library packages (STYLE habit 9), configured in setup.cfg's [mypy].
# The source folders are installed under the `reprise` name by package_dir, which mypy
# cannot follow, so it reads them through a tree of links named as installed.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
tree="$(mktemp -d)"
trap 'rm -rf "$tree"' EXIT
mkdir "$tree/reprise"
packages=(blockpool ipc cli cuda daemon)
args=()
for p in "${packages[@]}"; do
  ln -s "$root/$p" "$tree/reprise/$p"
  args+=(-p "reprise.$p")
done
cd "$tree"
"$root/.venv/bin/mypy" --config-file "$root/setup.cfg" --cache-dir "${MYPY_CACHE_DIR:-$root/.mypy_cache}" "${args[@]}" "$@"
