"""The engine: model loading, the Llama forward pass, sampling, tokenizer and
chat template, and (later) the server loop.

    from reprise.daemon import Engine, SamplingParams
    engine = Engine.from_pretrained()            # the default model, prepared if missing
    engine.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0))
"""

from .engine import Engine
from .params import Completion, Retention, SamplingParams

__all__ = ["Completion", "Engine", "Retention", "SamplingParams"]
