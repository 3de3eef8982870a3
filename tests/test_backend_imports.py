"""The backends import in one direction: backend.py reaches cupy_backend.py only inside
get_backend, and cupy_backend.py, like every caller, takes the protocol
from protocol.py, never from backend.py (no import circle)."""

from __future__ import annotations

import subprocess
import sys


def imported_after(statement: str) -> set[str]:
    """The reprise.cuda modules a fresh interpreter holds after `statement`."""
    code = f"import sys\n{statement}\nprint(*sorted(m for m in sys.modules if m.startswith('reprise.cuda')))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return set(done.stdout.split())


def test_cupy_backend_does_not_import_backend() -> None:
    loaded = imported_after("from reprise.cuda.cupy_backend import CupyBackend")
    assert "reprise.cuda.cupy_backend" in loaded
    assert "reprise.cuda.backend" not in loaded, sorted(loaded)


def test_backend_imports_cupy_backend_only_when_asked() -> None:
    loaded = imported_after("from reprise.cuda.backend import get_backend; get_backend('numpy')")
    assert "reprise.cuda.cupy_backend" not in loaded, sorted(loaded)
