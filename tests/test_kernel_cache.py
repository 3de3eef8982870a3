"""nvrtc.cubin_file: compiled cubins kept on disk between processes (gemm_sm90.cu for
sm_90a takes about 25 s to compile; each GPU test or benchmark process used to pay it)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from test_kernels_compile import nvrtc_or_skip

from reprise.cuda import nvrtc

ARCH = "sm_80"


@pytest.fixture
def source() -> str:
    """A small family's text (fast to compile), with a fresh constant so no earlier run's
    cache could hold it."""
    nvrtc_or_skip(ARCH)
    return nvrtc.kernel_source(nvrtc.KERNEL_DIR / "embedding.cu") + "\n// a test's own text\n"


@pytest.fixture
def compiles(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The sources compile_source is asked to compile, in order."""
    asked: list[str] = []
    compile_source = nvrtc.compile_source

    def counted(text: str, name: str, arch: str) -> nvrtc.Compiled:
        asked.append(text)
        return compile_source(text, name, arch)

    monkeypatch.setattr(nvrtc, "compile_source", counted)
    return asked


def test_a_second_process_loads_the_kept_cubin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, compiles: list[str]
) -> None:
    monkeypatch.setenv("REPRISE_KERNEL_CACHE", str(tmp_path / "kernels"))
    first = nvrtc.cubin_file(source, "embedding.cu", ARCH)
    assert first.parent == tmp_path / "kernels"
    assert first.read_bytes() == nvrtc.compile_source(source, "embedding.cu", ARCH).cubin
    assert len(compiles) == 2  # cubin_file's and the check's own
    again = nvrtc.cubin_file(source, "embedding.cu", ARCH)
    assert again == first and len(compiles) == 2  # kept: not compiled again
    assert not [p for p in first.parent.iterdir() if p.name.startswith(".part-")]
    assert first.parent.stat().st_mode & 0o077 == 0  # no other user writes what is loaded


def test_another_text_or_arch_is_another_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, compiles: list[str]
) -> None:
    monkeypatch.setenv("REPRISE_KERNEL_CACHE", str(tmp_path))
    files = {
        nvrtc.cubin_file(source, "embedding.cu", ARCH),
        nvrtc.cubin_file(source + "// edited\n", "embedding.cu", ARCH),
        nvrtc.cubin_file(source, "embedding.cu", "sm_90"),
    }
    assert len(files) == 3 and len(compiles) == 3


def test_a_damaged_file_is_compiled_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, compiles: list[str]
) -> None:
    monkeypatch.setenv("REPRISE_KERNEL_CACHE", str(tmp_path))
    path = nvrtc.cubin_file(source, "embedding.cu", ARCH)
    good = path.read_bytes()
    path.write_bytes(b"not a cubin")
    assert nvrtc.cubin_file(source, "embedding.cu", ARCH) == path
    assert path.read_bytes() == good and len(compiles) == 2


def test_a_cache_that_cannot_be_written_only_costs_the_compile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    source: str, compiles: list[str],
) -> None:  # fmt: skip
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("REPRISE_KERNEL_CACHE", str(blocker / "kernels"))  # no folder there
    with caplog.at_level(logging.WARNING, logger=nvrtc.__name__):
        path = nvrtc.cubin_file(source, "embedding.cu", ARCH)
    assert path.read_bytes()[:4] == b"\x7fELF" and not path.is_relative_to(blocker)
    assert [r.message for r in caplog.records if "not writable" in r.message]
    nvrtc.cubin_file(source, "embedding.cu", ARCH)
    assert len(compiles) == 2  # compiled each time


@pytest.mark.parametrize(
    "env",
    [{}, {"XDG_CACHE_HOME": "xdg"}, {"REPRISE_CACHE_DIR": "state", "XDG_CACHE_HOME": "xdg"}],
    ids=["home", "xdg", "reprise-cache"],
)
def test_the_default_folder_is_in_reprises_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, env: dict[str, str]
) -> None:
    """Without REPRISE_KERNEL_CACHE, the `kernels` folder of the cache the model lives in
    (prepare.cache_dir: under systemd, the unit's writable state directory)."""
    from reprise.daemon.model.prepare import cache_dir

    for name in ("REPRISE_KERNEL_CACHE", "REPRISE_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, str(tmp_path / value))
    assert nvrtc.cache_dir() == cache_dir() / "kernels"
    assert nvrtc.cache_dir().is_relative_to(tmp_path) == bool(env)
    monkeypatch.setenv("REPRISE_KERNEL_CACHE", str(tmp_path / "chosen"))
    assert nvrtc.cache_dir() == tmp_path / "chosen"
