"""Split GGUF models (llama.cpp's gguf-split: `<prefix>-00001-of-0000N.gguf`, ...): any shard
converts the whole set, byte for byte as the same model in one file does; a missing shard or
one whose split keys disagree is refused in one line naming it; a prepared folder goes stale
when any shard changes.

The shards are cut here from a tiny Llama written as llama.cpp's converter writes one (Q8_0
matrices, test_gguf_families' vocabulary), by gguf-py's writer with `split_max_tensors`, as
gguf-split cuts them: the metadata in the first shard, each tensor's bytes unchanged.
"""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf_support import set_gguf_value, split_gguf, write_gguf
from test_gguf_families import gguf_of, hf_source

from reprise.daemon.model import gguf_files
from reprise.daemon.model.gguf_convert import convert_gguf
from reprise.daemon.model.gguf_files import read_metadata
from reprise.daemon.model.prepare import (
    MARKER_NAME,
    cached_models,
    gguf_model_dir,
    prepare_gguf,
)

NUM_TENSORS = 21  # a two-layer Llama, untied: 9 a layer, the embedding, the norm, the head
MAX_TENSORS = 8  # a shard's: 8, 8 and 5
NAME = "tiny-split"  # general.name: README.md's title, so only the file names differ there


@pytest.fixture(scope="module")
def whole(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The model in one file, and the folder it converts to."""
    tmp = tmp_path_factory.mktemp("whole")
    model = hf_source("llama", 11)
    source = gguf_of(tmp / "whole.gguf", "llama", model, "llama-bpe", **{"general.name": NAME})
    convert_gguf(source, tmp / "out", progress=False)
    return source, tmp / "out"


@pytest.fixture
def shards(whole: tuple[Path, Path], tmp_path: Path) -> list[Path]:
    """The model cut into three shards, in a folder of this test's own."""
    return split_gguf(whole[0], tmp_path / "m.gguf", MAX_TENSORS)


def _assert_converts_as_whole(out: Path, whole_out: Path, first_name: str, num_files: int) -> None:
    """Every file as the one-file model's, README.md but for naming the files."""
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(p.name for p in whole_out.iterdir())
    bytes_equal = [n for n in names if n != "README.md"]
    assert filecmp.cmpfiles(out, whole_out, bytes_equal, shallow=False) == (bytes_equal, [], [])
    others = f" and its {num_files - 1} other shards" if num_files > 1 else ""
    readme = (whole_out / "README.md").read_text()
    assert (out / "README.md").read_text() == readme.replace(
        "from `whole.gguf`.", f"from `{first_name}`{others}."
    )


def test_the_shards_are_cut_as_gguf_split_cuts_them(shards: list[Path]) -> None:
    """The test's own premise: three shards named as llama.cpp names them, the metadata in
    the first, each with its split keys, the tensors spread 8, 8, 5."""
    assert [p.name for p in shards] == [f"m-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    metas = [read_metadata(p) for p in shards]
    for i, meta in enumerate(metas):
        assert (meta["split.no"], meta["split.count"]) == (i, 3)
        assert meta["split.tensors.count"] == NUM_TENSORS
    assert [m["GGUF.tensor_count"] for m in metas] == [8, 8, 5]
    assert metas[0]["general.name"] == NAME and "general.architecture" not in metas[1]


@pytest.mark.parametrize("given", [0, 1, 2])
def test_any_shard_converts_the_model_byte_for_byte_as_one_file(
    whole: tuple[Path, Path], shards: list[Path], tmp_path: Path, given: int
) -> None:
    convert_gguf(shards[given], tmp_path / "out", progress=False)
    _assert_converts_as_whole(tmp_path / "out", whole[1], shards[0].name, 3)


def test_a_file_named_as_a_shard_but_not_split_is_one_model(
    whole: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No split keys: its name alone makes it no shard, and its absent siblings are no
    matter, to the converter and the cache alike."""
    monkeypatch.setenv("REPRISE_CACHE_DIR", str(tmp_path / "cache"))
    plain = tmp_path / "plain-00002-of-00005.gguf"
    shutil.copyfile(whole[0], plain)
    convert_gguf(plain, tmp_path / "out", progress=False)
    _assert_converts_as_whole(tmp_path / "out", whole[1], plain.name, 1)
    first = prepare_gguf(plain, progress=False)
    assert first.created and first.path == gguf_model_dir(plain)
    assert "source_shards" not in json.loads((first.path / MARKER_NAME).read_text())
    assert not prepare_gguf(plain, progress=False).created


def test_any_shard_prepares_one_folder_named_by_the_first(
    shards: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REPRISE_CACHE_DIR", str(tmp_path / "cache"))
    made = prepare_gguf(shards[2], progress=False)
    assert made.created and made.path == gguf_model_dir(shards[0])
    for shard in shards:
        again = prepare_gguf(shard, progress=False)
        assert not again.created and again.path == made.path

    def unread(path: Path) -> None:
        raise AssertionError(f"{path} was read")

    # prepared and unchanged, the set is known by its names (a first shard takes seconds to read)
    monkeypatch.setattr(gguf_files, "open_gguf", unread)
    assert not prepare_gguf(shards[1], progress=False).created
    marker = json.loads((made.path / MARKER_NAME).read_text())
    assert marker["source"] == str(shards[0].resolve())
    assert [s[0] for s in marker["source_shards"]] == [str(p.resolve()) for p in shards[1:]]
    assert [m.path for m in cached_models()] == [made.path]


def test_a_changed_or_missing_shard_makes_the_folder_stale(
    shards: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REPRISE_CACHE_DIR", str(tmp_path / "cache"))
    folder = prepare_gguf(shards[0], progress=False).path
    assert [(m.path, m.stale) for m in cached_models()] == [(folder, False)]
    os.utime(shards[1], ns=(1, 1))  # the second shard changed: stale, and converted again
    assert [m.stale for m in cached_models()] == [True]
    assert prepare_gguf(shards[1], progress=False).created
    assert [m.stale for m in cached_models()] == [False]
    shards[2].unlink()
    assert [m.stale for m in cached_models()] == [True]
    with pytest.raises(ValueError) as refused:
        prepare_gguf(shards[0], progress=False)
    assert str(refused.value) == f"missing shard 3 of 3 of a split GGUF model: {shards[2]}"


def test_a_missing_shard_is_refused_by_its_path(shards: list[Path], tmp_path: Path) -> None:
    shards[1].unlink()
    for given in (shards[0], shards[2]):
        with pytest.raises(ValueError) as refused:
            convert_gguf(given, tmp_path / "out", progress=False)
        assert str(refused.value) == f"missing shard 2 of 3 of a split GGUF model: {shards[1]}"
    assert not (tmp_path / "out").exists()


def _needs(shard: Path, no: int, count: int, total: int, idx: int) -> str:
    return (
        f"{shard}: split.no {no}, split.count {count}, split.tensors.count {total}; shard "
        f"{idx + 1} of 3 ({NUM_TENSORS} tensors in all) needs split.no {idx}, split.count 3, "
        f"split.tensors.count {NUM_TENSORS}"
    )


@pytest.mark.parametrize(
    ("changed", "key", "value", "given", "message"),
    [
        (1, "split.no", 0, 0, lambda s: _needs(s[1], 0, 3, NUM_TENSORS, 1)),
        (2, "split.count", 4, 1, lambda s: _needs(s[2], 2, 4, NUM_TENSORS, 2)),
        (0, "split.tensors.count", 22, 2, lambda s: _needs(s[0], 0, 3, 22, 0)),
        (1, "split.tensors.count", 20, 0, lambda s: _needs(s[1], 1, 3, 20, 1)),
        # the shard given says it is another one: its keys do not name it
        (1, "split.no", 2, 1, lambda s: f"{s[1]}: split.no 2 and split.count 3 make it shard "
                                        "3 of 3, which llama.cpp names <prefix>-00003-of-00003.gguf"),
        (0, "split.no", 3, 0, lambda s: f"{s[0]}: split.count is 3 but split.no is 3; a shard "
                                        "of 3 needs one from 0 to 2"),
    ],
)  # fmt: skip
def test_a_shard_whose_split_keys_disagree_is_refused(
    shards: list[Path], tmp_path: Path, changed: int, key: str, value: int, given: int,
    message: Callable[[list[Path]], str],
) -> None:  # fmt: skip
    set_gguf_value(shards[changed], key, value)
    with pytest.raises(ValueError) as refused:
        convert_gguf(shards[given], tmp_path / "out", progress=False)
    assert str(refused.value) == message(shards)
    assert not (tmp_path / "out").exists()


def test_a_split_file_not_named_as_a_shard_is_refused(shards: list[Path], tmp_path: Path) -> None:
    renamed = shards[0].with_name("model.gguf")
    shards[0].rename(renamed)
    with pytest.raises(ValueError) as refused:
        convert_gguf(renamed, tmp_path / "out", progress=False)
    assert str(refused.value) == (
        f"{renamed}: split.no 0 and split.count 3 make it shard 1 of 3, which llama.cpp names "
        "<prefix>-00001-of-00003.gguf"
    )


def test_a_tensor_in_two_shards_is_refused(shards: list[Path], tmp_path: Path) -> None:
    """The last shard written again with the first shard's embedding among its five."""
    names = [*(t.name for t in gguf.GGUFReader(shards[2]).tensors[:4]), "token_embd.weight"]
    keys = {"split.no": 2, "split.count": 3, "split.tensors.count": NUM_TENSORS}
    tensors = {name: np.zeros(32, np.float32) for name in names}
    os.replace(write_gguf(tmp_path / "x.gguf", "llama", keys, tensors, quantized=False), shards[2])
    with pytest.raises(ValueError) as refused:
        convert_gguf(shards[0], tmp_path / "out", progress=False)
    assert str(refused.value) == f"{shards[2]}: tensor 'token_embd.weight' is in {shards[0]} too"


def test_the_command_line_takes_any_shard_and_refuses_in_one_line(
    shards: list[Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REPRISE_CACHE_DIR", str(tmp_path / "cache"))
    env = {**os.environ}
    cli = [sys.executable, "-m", "reprise.cli.main"]

    def reprise(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*cli, *args], capture_output=True, text=True, env=env, timeout=120)

    done = reprise("model", "convert", str(shards[1]))
    assert done.returncode == 0, done.stderr
    folder = gguf_model_dir(shards[0])
    assert done.stdout.strip().splitlines()[-1] == str(folder)
    assert (folder / "model.safetensors").is_file()
    shards[2].unlink()
    missing = f"Error: missing shard 3 of 3 of a split GGUF model: {shards[2]}"
    for args in (["model", "convert", str(shards[0])], ["run", "hi", "--model", str(shards[1])]):
        done = reprise(*args)
        assert done.returncode == 1 and done.stderr.strip().splitlines() == [missing], args


def test_a_safetensors_model_loads_and_runs_without_the_gguf_package(tmp_path: Path) -> None:
    """Only a GGUF file needs gguf-py: with the package unimportable (as on the lent GPU
    machines, whose image lacks it), a safetensors folder loads through
    Engine.from_pretrained and generates, and the model modules import (gguf_files reads
    the package inside its functions; a 2026-11-30 H200 run caught a top-level import that
    failed every engine test there)."""
    from reprise.daemon.model.synth import synth_model

    folder = synth_model("tiny", tmp_path / "m", seed=3)
    script = f"""
import sys
sys.modules["gguf"] = None  # `import gguf` raises ImportError
from reprise.daemon import Engine, SamplingParams
from reprise.daemon.model import gguf_config, gguf_convert, gguf_experts, gguf_families, gguf_files, prepare
engine = Engine.from_pretrained({str(folder)!r}, backend="numpy")
out = engine.generate([1, 2, 3], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
print(len(out.token_ids))
try:
    gguf_files.open_gguf({str(folder / "config.json")!r})
except ImportError:
    print("needs gguf")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["2", "needs", "gguf"]
