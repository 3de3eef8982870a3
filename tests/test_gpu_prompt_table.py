"""Prompt tables on the GPU backend (default model, or its synthetic shape): TensorRT-LLM's
p-tuning example at block size 16, with decode graphs; every logit equals the same
request's alone on a fresh engine. Skipped without a CUDA device (run by
scripts/gpu_check.sh, which collects tests/test_gpu_*.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gpu_support import needs_gpu

from reprise.cuda.dtypes import BF16
from reprise.daemon import Engine, SamplingParams

pytestmark = [pytest.mark.gpu, needs_gpu]
BS = 16
PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, return_logits=True)


def test_trtllm_example_on_the_gpu(default_model_dir: Path) -> None:
    engine = Engine.from_pretrained(default_model_dir, backend="cupy", block_size=BS,
                                    num_device_blocks=64, cuda_graphs=True)  # fmt: skip
    cfg = engine.config
    rng = np.random.default_rng(24)
    t1, t2 = ((rng.standard_normal((BS, cfg.hidden_size)) * 0.05).astype(BF16) for _ in "12")
    fake = list(range(cfg.vocab_size, cfg.vocab_size + BS))
    text1, text2 = list(range(100, 100 + BS)), list(range(300, 300 + BS))
    requests = [
        ([*fake, *text1], t1, [1] * BS + [0] * BS),
        ([*fake, *text1], t2, [2] * BS + [0] * BS),
        ([*fake, *text2], t1, [1] * BS + [0] * BS),
    ]
    outs = [engine.generate(p, PARAMS, prompt_table=t, extra_ids=e) for p, t, e in requests]
    assert [o.cached_tokens for o in outs] == [0, 0, BS]
    assert not np.array_equal(outs[0].logits, outs[1].logits)
    fresh = Engine(cfg, engine.tokenizer, engine.runner.model, block_size=BS,
                   num_device_blocks=64, enable_reuse=False)  # fmt: skip
    for (prompt, table, extra), out in zip(requests, outs, strict=True):
        alone = fresh.generate(prompt, PARAMS, prompt_table=table, extra_ids=extra)
        assert np.array_equal(out.logits, alone.logits)
