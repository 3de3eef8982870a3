"""The model fingerprint covers the weight bytes, not only the names and shapes."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from reprise.daemon.model.fingerprint import model_fingerprint
from reprise.daemon.model.safetensors_io import read_header
from reprise.daemon.model.synth import synth_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth_model("tiny", tmp_path_factory.mktemp("fp") / "tiny")


def test_same_bytes_same_fingerprint(tiny: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(tiny, tmp_path / "copy"))
    assert model_fingerprint(copy) == model_fingerprint(tiny)
    assert len(model_fingerprint(tiny)) == 32


def test_one_weight_byte_changes_it_with_same_size_and_mtime(tiny: Path, tmp_path: Path) -> None:
    """A re-prepared checkpoint with the same shapes, size and mtime must not match."""
    copy = Path(shutil.copytree(tiny, tmp_path / "copy"))
    shard = sorted(copy.glob("*.safetensors"))[-1]
    st = shard.stat()
    _, data_start = read_header(shard)
    with open(shard, "r+b") as f:  # the last byte of the tensor data, far from the header
        f.seek(st.st_size - 1)
        byte = f.read(1)
        f.seek(st.st_size - 1)
        f.write(bytes([byte[0] ^ 1]))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert shard.stat().st_size == st.st_size and st.st_size - 1 >= data_start
    assert model_fingerprint(copy) != model_fingerprint(tiny)


def test_config_changes_it(tiny: Path, tmp_path: Path) -> None:
    copy = Path(shutil.copytree(tiny, tmp_path / "copy"))
    (copy / "config.json").write_text((copy / "config.json").read_text() + "\n")
    assert model_fingerprint(copy) != model_fingerprint(tiny)
