"""The daemon, in three layers (each a sub-package; nothing points back up):

- `model/`: a checkpoint and what it computes: config, weights, safetensors and
  GGUF conversion, preparing the default model, synthetic weights, tokenizer and
  chat template, and the Llama forward pass.
- `engine/`: the step loop over a model: requests and sampling parameters,
  sequences, the scheduler and KV cache manager, the model runner, decode graphs,
  and the engine that ties them together.
- `serve/`: the long-lived process: the ZeroMQ server loop, systemd glue, logs.

    from reprise.daemon import Engine, SamplingParams
    engine = Engine.from_pretrained()            # the default model, prepared if missing
    engine.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0))
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    from .engine.engine import Engine
    from .engine.params import Completion, Retention, SamplingParams, StructuredOutput

__all__ = ["Completion", "Engine", "Retention", "SamplingParams", "StructuredOutput"]


def __getattr__(name: str) -> Any:
    """The public names, imported on first use: `reprise.daemon.engine.config` (which
    the CLI reads for its flags) must not pull in the engine, NumPy and tokenizers."""
    if name == "Engine":
        from .engine.engine import Engine

        return Engine
    if name in ("Completion", "Retention", "SamplingParams", "StructuredOutput"):
        from .engine import params

        return getattr(params, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
