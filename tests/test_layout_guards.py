"""Guards for issue 22's shape: the CLI's engine flags come from EngineConfig's fields
(one source for flags, help texts and defaults), and the package imports itself by
relative imports (so editors and static tools can follow them)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from click.testing import CliRunner

from reprise.cli.main import main
from reprise.daemon.engine.config import setting_fields

ROOT = Path(__file__).resolve().parent.parent
PACKAGE_FOLDERS = ("blockpool", "cli", "cuda", "daemon", "ipc", "bench")


@pytest.mark.parametrize("command", ["serve", "bench"])
def test_every_engine_setting_is_a_flag_with_the_fields_help(command: str) -> None:
    result = CliRunner().invoke(main, [command, "--help"], terminal_width=400)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())  # help texts wrap
    for f in setting_fields():
        flag = str(f.metadata["flag"])
        assert flag.replace("/", " / ") in text or flag in text, (command, flag)
        first_words = " ".join(str(f.metadata["help"]).split()[:4])
        assert first_words in text, (command, f.name, first_words)
        if f.default is not None and not isinstance(f.default, bool):
            assert f"[default: {f.default}]" in text or "[default:" in str(f.metadata["help"]), (
                command,
                f.name,
            )


def _absolute_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            continue
        found += [f"{path.name}:{node.lineno} {n}" for n in names
                  if n == "reprise" or n.startswith("reprise.")]  # fmt: skip
    return found


def test_the_package_imports_itself_relatively() -> None:
    """Inside the package every import of reprise is relative; the benchmark scripts in
    bench/ that run by path (bench_*.py, with a __main__) are the exception."""
    offenders = []
    for folder in PACKAGE_FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if folder == "bench" and path.name.startswith("bench_"):
                continue
            offenders += _absolute_imports(path)
    assert offenders == []


def test_the_guard_sees_an_absolute_import(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("from reprise.cli import main\nimport reprise.daemon\nfrom . import x\n")
    assert [line.split()[-1] for line in _absolute_imports(probe)] == [
        "reprise.cli",
        "reprise.daemon",
    ]
