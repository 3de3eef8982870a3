"""The HTTP API's sampling defaults from the model's `generation_config.json`, as vLLM's
`--generation-config` takes them.

A model's creators often recommend how to sample it (Qwen3: temperature 0.6, top_p
0.95, top_k 20) in `generation_config.json`. vLLM's OpenAI server uses those values for a
request that does not set them (`--generation-config auto`, its default) and none with
`--generation-config vllm`; `--override-generation-config` (a JSON object) sets some on top.
We do the same (`generation_defaults`), with these guarantees:

- only the keys vLLM reads are taken: `temperature`, `top_p`, `top_k`, `min_p`,
  `repetition_penalty`, and `max_new_tokens` (a request's `max_tokens` when it sets
  none); other keys (`do_sample` among them, as vLLM ignores it) change nothing;
- the values are checked as a request's would be, when the server starts: a bad one is
  refused in one line naming the file or the flag, before the model loads;
- a request's own value always wins; the defaults reach HTTP requests only (the socket
  protocol's requests say what they want, as vLLM's engine's do).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..engine.sampling.params import SamplingParams

# generation_config.json's name -> the request's (SamplingParams') name
KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
SOURCES = ("auto", "vllm")  # or a folder holding a generation_config.json


def generation_defaults(
    source: str, model_dir: Path | None, override: str | None = None
) -> dict[str, Any]:
    """The request defaults (SamplingParams names) for `--generation-config SOURCE`: "auto"
    reads `model_dir`'s generation_config.json (none when there is no folder or no file),
    "vllm" none, anything else is a folder that must hold one; `override` (a JSON object of
    generation_config.json names) is applied on top. Raises ValueError naming what is wrong."""
    if source == "vllm":
        found: dict[str, Any] = {}
    elif source == "auto":
        path = None if model_dir is None else Path(model_dir) / "generation_config.json"
        found = _read(path) if path is not None and path.is_file() else {}
    else:
        path = Path(source) / "generation_config.json"
        if not path.is_file():
            raise ValueError(
                f"--generation-config {source}: no generation_config.json there (give a "
                "folder holding one, 'auto' for the model's or 'vllm' for none)"
            )
        found = _read(path)
    defaults = {KEYS[k]: v for k, v in found.items() if k in KEYS}
    if override is not None:
        try:
            given = json.loads(override)
        except ValueError as e:
            raise ValueError(f"--override-generation-config is not JSON: {e}") from None
        if not isinstance(given, dict):
            raise ValueError("--override-generation-config must be a JSON object")
        unknown = sorted(set(given) - set(KEYS))
        if unknown:
            raise ValueError(
                f"--override-generation-config: unknown key {unknown[0]!r}; known: "
                + ", ".join(KEYS)
            )
        defaults |= {KEYS[k]: v for k, v in given.items()}
    if defaults.get("top_k") in (-1, 0):  # "no limit", as a request's top_k
        del defaults["top_k"]
    try:
        SamplingParams(**defaults)
    except (TypeError, ValueError) as e:
        where = "--override-generation-config" if override is not None else "generation_config"
        raise ValueError(f"{where}: {e}") from None
    return defaults


def _read(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{path}: cannot be read as JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: not a JSON object")
    return value
