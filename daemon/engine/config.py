"""Every setting of an engine, in one frozen `EngineConfig`, validated once.

The Python API (`Engine(..., settings)`, `Engine.from_pretrained(**settings)`),
`reprise serve`, `reprise bench` and the benchmarks all build an engine from
this class; `reprise serve`'s flags, their help texts and defaults are made
from its fields (cli/options.py), so a setting is spelled out here and nowhere
else, and a bad one is refused before any model is loaded.

Each field's metadata holds its flag and help text; a bad value raises
`SettingError` naming the field and its flag, the value, and what is allowed.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, fields
from typing import Any

BACKENDS: tuple[str, ...] = ("auto", "numpy", "cupy")
MAX_BLOCK_SIZE = 1024
GPU_STEP_TOKENS, NUMPY_STEP_TOKENS = 2048, 256
DEFAULT_KV_CACHE_BYTES = 1 << 30
DEFAULT_DISK_CACHE_GB = 16.0
DEFAULT_MAX_PROMPT_LOGPROBS, MAX_PROMPT_LOGPROBS = 20, 1000  # vLLM's max_logprobs default is 20
# 64 MiB: 340 rows of the default model's 49152-entry vocabulary, 130 of a 128k one; a
# row costs 4 bytes per vocabulary entry, a trifle beside the KV blocks it stands for.
DEFAULT_LOGITS_CACHE_MB = 64
# prompt lookup speculation (speculative.py): the most draft tokens a step may check for
# a request, and the longest n-gram it looks for
MAX_SPECULATIVE_TOKENS, MAX_PROMPT_LOOKUP = 32, 64
# vLLM's max_num_seqs: the largest decode graph's batch (graphs.DEFAULT_BUCKETS), so that a
# step of decodes alone always replays a graph
DEFAULT_MAX_NUM_SEQS = 256


class SettingError(ValueError):
    """A bad setting: `name` is the EngineConfig field, `flag` its CLI spelling."""

    def __init__(self, name: str, message: str) -> None:
        self.name = name
        self.flag = flag_of(name)
        super().__init__(message)


def _setting(default: Any, flag: str, help: str, **extra: Any) -> Any:
    return field(default=default, metadata={"flag": flag, "help": help, **extra})


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """What an engine is built from. None means "the default" where the help says so."""

    model: str | None = _setting(
        None, "--model",
        "Model folder, or a GGUF file (llama.cpp's; converted to BF16 into the cache once) "
        "[default: the default model, prepared if missing].",
    )  # fmt: skip
    backend: str = _setting(
        "auto", "--backend", "Where the model runs: auto picks cupy when a GPU is present.",
        choices=BACKENDS,
    )  # fmt: skip
    block_size: int = _setting(
        32, "--block-size", "Tokens per KV block (a power of two; 16, 32 or 64 on the GPU)."
    )
    num_device_blocks: int | None = _setting(
        None, "--num-device-blocks", "KV blocks on the device [default: 1 GiB worth]."
    )
    memory_fraction: float | None = _setting(
        None, "--memory-fraction",
        "Size the device pool to fill this fraction of the device's memory beside the weights "
        "(GPU memory; RAM on the NumPy backend), instead of --num-device-blocks.",
    )  # fmt: skip
    num_host_blocks: int = _setting(0, "--host-blocks", "Blocks in the host tier.")
    host_bytes: int | None = _setting(
        None, "--host-bytes", "Host tier size in bytes (instead of --host-blocks)."
    )
    enable_reuse: bool = _setting(
        True, "--reuse/--no-reuse", "Find cached KV blocks again across requests."
    )
    logits_cache_mb: int | None = _setting(
        None, "--logits-cache-mb",
        "MiB of prompts' last logits rows kept (least recently used go first), so that an "
        "exact repeat (same tokens and salt, every token's KV cached) samples its first "
        f"token with no forward step; 0 turns it off. Needs --reuse [default: "
        f"{DEFAULT_LOGITS_CACHE_MB} with --reuse, 0 with --no-reuse].",
    )  # fmt: skip
    max_num_batched_tokens: int | None = _setting(
        None, "--max-batched-tokens",
        f"Token budget per engine step, which bounds a step's time [default: {GPU_STEP_TOKENS} "
        f"on the GPU, {NUMPY_STEP_TOKENS} on NumPy, where a {NUMPY_STEP_TOKENS}-token step of the "
        "default model takes about 2 s].",
    )  # fmt: skip
    max_model_len: int | None = _setting(
        None, "--max-model-len",
        "Context length [default: the model's]. A LongRoPE model's factor list follows it: "
        "the long one past its original context, for every position.",
    )  # fmt: skip
    hf_overrides: str | None = _setting(
        None, "--hf-overrides",
        "A JSON object of config.json fields that replace the model's (vLLM's), e.g. "
        '\'{"rope_scaling": {"rope_type": "yarn", "factor": 4.0, '
        '"original_max_position_embeddings": 32768}}\' for Qwen2.5\'s long context.',
    )  # fmt: skip
    max_num_seqs: int = _setting(
        DEFAULT_MAX_NUM_SEQS, "--max-num-seqs",
        "Most requests running at once (vLLM's); more wait their turn. The default is the "
        "largest decode graph's batch.",
    )  # fmt: skip
    cuda_graphs: bool | None = _setting(
        None, "--cuda-graphs/--eager",
        "Replay decode steps as CUDA graphs, one per batch-size bucket, captured at start-up "
        "[default: on with the GPU backend; --cuda-graphs on NumPy runs the same padded steps].",
    )  # fmt: skip
    async_scheduling: bool = _setting(
        False, "--async-scheduling/--no-async-scheduling",
        "Launch the next decode step before this one's tokens are read back (vLLM's "
        "async scheduling), so the device runs it while the host records them; the tokens "
        "it is fed come from the device, and the output is bit-identical. Steps of decodes "
        "alone with no penalties, grammar, bad word sequences, logprobs or drafts run so. "
        "Needs decode graphs [default: off].",
    )  # fmt: skip
    kv_events: bool = _setting(
        False, "--kv-events/--no-kv-events",
        "Keep KV cache events (BlockStored, BlockRemoved, AllBlocksCleared) for "
        "Engine.take_events(), as vLLM's enable_kv_cache_events; serve turns it on with --events "
        "[default: off: no event is made].",
    )  # fmt: skip
    speculative_tokens: int = _setting(
        0, "--speculative-tokens",
        "Draft tokens a decode step checks per request (prompt lookup: the tokens that "
        "followed the last n-gram's latest earlier occurrence in its prompt and output, as "
        "vLLM's ngram method); the output stays bit-identical to decoding without them. "
        f"0 turns it off; at most {MAX_SPECULATIVE_TOKENS}.",
    )  # fmt: skip
    prompt_lookup_min: int = _setting(
        2, "--prompt-lookup-min",
        "Shortest n-gram (the sequence's last tokens) a draft may follow.",
    )  # fmt: skip
    prompt_lookup_max: int = _setting(
        5, "--prompt-lookup-max",
        "Longest n-gram looked for first (the longest match found wins).",
    )  # fmt: skip
    speculative_disable_by_batch_size: int | None = _setting(
        None, "--speculative-disable-by-batch-size",
        "No drafts while more than this many requests run (vLLM's disable_by_batch_size); "
        "with decode graphs at most 16, past which a drafted step would run eagerly "
        "[default: no limit but the graphs'].",
    )  # fmt: skip
    max_prompt_logprobs: int = _setting(
        DEFAULT_MAX_PROMPT_LOGPROBS, "--max-prompt-logprobs",
        "Most top alternatives a request's prompt_logprobs may ask for per prompt token; "
        "prompt blocks keep this many beside their KV, so cached prompts serve them.",
    )  # fmt: skip

    seed: int | None = _setting(
        None, "--seed",
        "Seed the random seeds of requests that give none, one after another as they are "
        "added, so a run's sampled answers repeat when its requests come in the same order "
        "(vLLM's --seed) [default: fresh randomness each request].",
    )  # fmt: skip

    disk_cache: str | None = _setting(
        None, "--disk-cache",
        "Keep KV blocks as files in this existing folder (one subfolder per model and "
        "layout), found again after a restart [default: no disk tier].",
    )  # fmt: skip
    disk_cache_gb: float = _setting(
        DEFAULT_DISK_CACHE_GB, "--disk-cache-gb",
        "Most GiB of block files the disk tier keeps (least recently used go first).",
    )  # fmt: skip

    def __post_init__(self) -> None:
        if self.model is not None and (not isinstance(self.model, str) or not self.model):
            raise SettingError(
                "model", f"model must be a folder or GGUF file path; got {self.model!r}"
            )
        if self.backend not in BACKENDS:
            raise SettingError(
                "backend", f"backend must be one of {BACKENDS}; got {self.backend!r}"
            )
        bs = self.block_size
        if not _is_int(bs) or not 1 <= bs <= MAX_BLOCK_SIZE or bs & (bs - 1):
            raise SettingError(
                "block_size",
                f"block_size must be a power of two in [1, {MAX_BLOCK_SIZE}]; got {bs!r}",
            )
        _check_int("num_device_blocks", self.num_device_blocks, low=1, optional=True)
        fraction = self.memory_fraction
        if fraction is not None and not (
            isinstance(fraction, int | float)
            and not isinstance(fraction, bool)
            and math.isfinite(fraction)
            and 0 < fraction <= 1
        ):
            raise SettingError(
                "memory_fraction", f"memory_fraction must be in (0, 1]; got {fraction!r}"
            )
        if fraction is not None and self.num_device_blocks is not None:
            raise SettingError(
                "memory_fraction",
                "give num_device_blocks or memory_fraction, not both "
                f"(--num-device-blocks {self.num_device_blocks}, --memory-fraction {fraction})",
            )
        _check_int("num_host_blocks", self.num_host_blocks, low=0)
        _check_int("host_bytes", self.host_bytes, low=1, optional=True)
        if self.host_bytes is not None and self.num_host_blocks:
            raise SettingError(
                "host_bytes",
                "give num_host_blocks or host_bytes, not both "
                f"(--host-blocks {self.num_host_blocks}, --host-bytes {self.host_bytes})",
            )
        if not isinstance(self.enable_reuse, bool):
            raise SettingError(
                "enable_reuse", f"enable_reuse must be a bool; got {self.enable_reuse!r}"
            )
        if not isinstance(self.kv_events, bool):
            raise SettingError("kv_events", f"kv_events must be a bool; got {self.kv_events!r}")
        _check_int("logits_cache_mb", self.logits_cache_mb, low=0, optional=True)
        if not self.enable_reuse and self.logits_cache_mb:
            raise SettingError(
                "logits_cache_mb",
                f"logits_cache_mb ({self.logits_cache_mb}) needs reuse: exact repeats are "
                "found in the prefix cache, which --no-reuse turns off",
            )
        _check_int("max_num_batched_tokens", self.max_num_batched_tokens, low=1, optional=True)
        _check_int("max_model_len", self.max_model_len, low=2, optional=True)
        self.config_overrides()  # a SettingError for text that is not a JSON object
        _check_int("max_num_seqs", self.max_num_seqs, low=1)
        if self.cuda_graphs is not None and not isinstance(self.cuda_graphs, bool):
            raise SettingError(
                "cuda_graphs", f"cuda_graphs must be a bool or None; got {self.cuda_graphs!r}"
            )
        if not isinstance(self.async_scheduling, bool):
            raise SettingError(
                "async_scheduling",
                f"async_scheduling must be a bool; got {self.async_scheduling!r}",
            )
        if self.async_scheduling and self.cuda_graphs is False:
            raise SettingError(
                "async_scheduling",
                "async_scheduling needs decode graphs, which --eager turns off: the device "
                "feeds a launched step's tokens into the graph's inputs",
            )
        if self.async_scheduling and self.speculative_tokens:
            raise SettingError(
                "async_scheduling",
                f"async_scheduling does not combine with speculative_tokens "
                f"({self.speculative_tokens}): a draft is made from the tokens on the host",
            )
        spec = self.speculative_tokens
        if not _is_int(spec) or not 0 <= spec <= MAX_SPECULATIVE_TOKENS:
            raise SettingError(
                "speculative_tokens",
                f"speculative_tokens must be an integer in [0, {MAX_SPECULATIVE_TOKENS}]; "
                f"got {spec!r}",
            )
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not _is_int(value) or not 1 <= value <= MAX_PROMPT_LOOKUP:
                raise SettingError(
                    name, f"{name} must be an integer in [1, {MAX_PROMPT_LOOKUP}]; got {value!r}"
                )
        _check_int(
            "speculative_disable_by_batch_size",
            self.speculative_disable_by_batch_size,
            low=1,
            optional=True,
        )
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise SettingError(
                "prompt_lookup_min",
                f"prompt_lookup_min ({self.prompt_lookup_min}) must be at most "
                f"prompt_lookup_max ({self.prompt_lookup_max})",
            )
        top = self.max_prompt_logprobs
        if not _is_int(top) or not 0 <= top <= MAX_PROMPT_LOGPROBS:
            raise SettingError(
                "max_prompt_logprobs",
                f"max_prompt_logprobs must be an integer in [0, {MAX_PROMPT_LOGPROBS}]; got {top!r}",
            )
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 1 << 64):
            raise SettingError("seed", f"seed must be an integer in [0, 2**64); got {self.seed!r}")
        gb = self.disk_cache_gb
        if (
            isinstance(gb, bool)
            or not isinstance(gb, int | float)
            or not (math.isfinite(gb) and gb > 0)
        ):
            raise SettingError("disk_cache_gb", f"disk_cache_gb must be > 0; got {gb!r}")
        _check_disk_cache(self.disk_cache)

    def config_overrides(self) -> dict[str, Any] | None:
        """`hf_overrides` parsed: the config.json fields it replaces, or None."""
        if self.hf_overrides is None:
            return None
        try:
            overrides = json.loads(self.hf_overrides)
        except (TypeError, ValueError) as e:
            raise SettingError(
                "hf_overrides", f"hf_overrides must be a JSON object of config.json fields: {e}"
            ) from None
        if not isinstance(overrides, dict):
            raise SettingError(
                "hf_overrides",
                f"hf_overrides must be a JSON object of config.json fields; got {self.hf_overrides!r}",
            )
        return overrides

    @property
    def logits_cache_bytes(self) -> int:
        """The exact-repeat logits cache's bound; 0 when it is off (or reuse is)."""
        if not self.enable_reuse:
            return 0
        mb = DEFAULT_LOGITS_CACHE_MB if self.logits_cache_mb is None else self.logits_cache_mb
        return mb << 20

    @property
    def disk_cache_bytes(self) -> int:
        return int(self.disk_cache_gb * 2**30)

    def step_budget(self, on_gpu: bool) -> int:
        """The chunked-prefill token budget: the setting, or one that keeps a step (and
        so the watchdog ping and a SIGTERM's answer) to seconds on this backend."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return GPU_STEP_TOKENS if on_gpu else NUMPY_STEP_TOKENS

    def host_blocks(self, block_bytes: int) -> int:
        """Host tier blocks: `num_host_blocks`, or as many as `host_bytes` holds."""
        if self.host_bytes is None:
            return self.num_host_blocks
        if self.host_bytes < block_bytes:
            raise SettingError(
                "host_bytes",
                f"a host tier of {self.host_bytes} bytes holds no KV block of {block_bytes} bytes",
            )
        return self.host_bytes // block_bytes

    def device_blocks(self, block_bytes: int, device_bytes: int, weight_bytes: int) -> int:
        """Device pool blocks: `num_device_blocks`, a `memory_fraction` of the device,
        or 1 GiB worth."""
        if self.num_device_blocks is not None:
            return self.num_device_blocks
        if self.memory_fraction is None:
            return max(DEFAULT_KV_CACHE_BYTES // block_bytes, 1)
        budget = int(self.memory_fraction * device_bytes * 0.9) - weight_bytes
        if budget < block_bytes:  # a tenth of the share is kept for activations
            raise SettingError(
                "memory_fraction",
                f"memory_fraction {self.memory_fraction} of {device_bytes / 2**30:.1f} GiB "
                f"leaves no room for KV blocks beside {weight_bytes / 2**30:.2f} GiB of weights; "
                "raise it or give num_device_blocks",
            )
        return budget // block_bytes


def setting_fields() -> tuple[Any, ...]:
    """EngineConfig's fields, in order (each with its flag and help in `metadata`)."""
    return fields(EngineConfig)


def flag_of(name: str) -> str:
    """The CLI flag of an EngineConfig field (the positive one of an on/off pair)."""
    for f in fields(EngineConfig):
        if f.name == name:
            return str(f.metadata["flag"]).split("/")[0]
    raise KeyError(name)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_int(name: str, value: object, *, low: int, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not _is_int(value) or value < low:  # type: ignore[operator]
        raise SettingError(name, f"{name} must be an integer >= {low}; got {value!r}")


def _check_disk_cache(folder: object) -> None:
    """A disk cache folder must exist and be writable when the engine starts: a typo or
    a wrong mount is refused here, before the model loads. (What goes wrong later, a
    full disk or a read-only remount, logs one warning and the engine serves on
    without the tier; see blockpool/disk.py.)"""
    if folder is None:
        return
    if not isinstance(folder, str) or not folder:
        raise SettingError("disk_cache", f"disk_cache must be a folder path; got {folder!r}")
    if not os.path.isdir(folder):
        what = "is not a folder" if os.path.exists(folder) else "does not exist"
        raise SettingError("disk_cache", f"disk_cache {folder!r} {what}; create it first")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise SettingError("disk_cache", f"disk_cache {folder!r} is not writable by this user")
