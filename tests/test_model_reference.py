"""The Llama forward pass against Hugging Face transformers on small random
models: GQA, llama3 rope scaling, tied and untied heads, sharded checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from reprise.cuda.backend import NumpyBackend
from reprise.cuda.kvcache import kv_cache_shape
from reprise.daemon.model.config import ModelConfig, ModelConfigError
from reprise.daemon.model.llama import ForwardBatch, LlamaModel
from reprise.daemon.model.weights import WeightsError, load_weights

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.reference

TINY = dict(
    vocab_size=300,
    hidden_size=96,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
)


def make_hf_model(out: Path, seed: int, **overrides) -> torch.nn.Module:
    """A random LlamaForCausalLM saved as BF16 safetensors; returned in fp32 (same values)."""
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**{**TINY, **overrides})
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # the default init is too small to exercise much; widen it
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else p.copy_(1 + 0.2 * torch.randn_like(p))
    model = model.to(torch.bfloat16)
    model.save_pretrained(out, max_shard_size=overrides.pop("_shard", "2GB"))
    return model.float().eval()


def save_widened(model: torch.nn.Module, out: Path, vocab_size: int) -> torch.nn.Module:
    """`model` (a transformers model, randomly initialized under a seed) widened as
    make_hf_model's, saved to `out` as BF16 safetensors with a synthetic tokenizer, and
    returned in fp32 (the same values)."""
    from reprise.daemon.model.synth import write_tokenizer

    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else p.copy_(1 + 0.2 * torch.randn_like(p))
    model = model.to(torch.bfloat16)
    model.save_pretrained(out)
    write_tokenizer(out, vocab_size)
    return model.float().eval()


def matches_transformers(
    path: Path, reference: torch.nn.Module, vocab_size: int, size: int = 150
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Our forward on `path` against `reference`'s fp32 logits on a random prompt, in one
    chunk and in four: within this module's bound and mostly the same argmax. Returns
    (our logits, the prompt, each row's error), the last run's, for a family's checks."""
    prompt = np.random.default_rng(7).integers(0, vocab_size, size=size)
    want = hf_logits(reference, prompt)
    for chunks in ([size], [1, 40, 64, size - 105]):
        ours = run_ours(path, prompt, chunks)
        err = rel_l2_rows(ours, want)
        assert err.max() < 2e-2, err.max()
        assert (ours.argmax(-1) == want.argmax(-1)).mean() > 0.95
    return ours, prompt, err


def reuse_keeps_bits(path: Path, vocab_size: int) -> None:
    """The engine on `path` (NumPy): a prompt prefilled in 48-token chunks, then again with
    112 of its tokens cached, gives the same tokens and logits, bit for bit."""
    from reprise.daemon import Engine, SamplingParams

    engine = Engine.from_pretrained(path, backend="numpy", num_device_blocks=64,
                                    block_size=16, max_num_batched_tokens=48)  # fmt: skip
    prompt = np.random.default_rng(8).integers(3, vocab_size, size=120).tolist()
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, return_logits=True)
    fresh = engine.generate(prompt, params)
    again = engine.generate(prompt, params)
    assert again.cached_tokens >= 112 and again.token_ids == fresh.token_ids
    assert np.array_equal(again.logits.view(np.uint32), fresh.logits.view(np.uint32))


def run_ours(
    path: Path, prompt: np.ndarray, chunks: list[int], block_size: int = 16,
    max_model_len: int | None = None, pad_to: int | None = None,
) -> np.ndarray:  # fmt: skip
    """All positions' logits, computing the prompt in the given chunk sizes (the config
    loaded for an engine of `max_model_len`, its heads padded to `pad_to` if given)."""
    config = ModelConfig.from_dir(path, max_model_len)
    if pad_to is not None:
        config = config.padded(pad_to)
    model = LlamaModel(config, load_weights(path, config), NumpyBackend())
    num_blocks = -(-len(prompt) // block_size)
    cache = np.zeros(
        kv_cache_shape(
            num_blocks + 4, config.num_layers, config.num_kv_heads, block_size, config.head_dim
        ),
        np.float32,
    ).astype(model.embed_tokens.dtype)
    table = np.random.default_rng(1).permutation(num_blocks + 4)[:num_blocks].astype(np.int32)
    rows, start = [], 0
    for n in chunks:
        pos = np.arange(start, start + n)
        batch = ForwardBatch(
            token_ids=prompt[start : start + n].astype(np.int32),
            positions=pos.astype(np.int32),
            slot_mapping=table[pos // block_size].astype(np.int64) * block_size + pos % block_size,
            block_tables=table[None],
            seq_lens=np.array([start + n], np.int32),
            query_start_loc=np.array([0, n], np.int32),
            logit_rows=np.arange(n, dtype=np.int32),
        )
        rows.append(model.forward(batch, cache))
        start += n
    assert start == len(prompt)
    return np.concatenate(rows)


def hf_logits(model, prompt: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(prompt[None], dtype=torch.long)).logits[0].numpy()


def rel_l2_rows(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"tie_word_embeddings": True},
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        },
        {"num_key_value_heads": 6, "head_dim": None, "_shard": "100KB"},
    ],
    ids=["untied", "tied", "llama3-rope", "mha-sharded"],
)
def test_logits_match_transformers(tmp_path: Path, overrides: dict) -> None:
    overrides = {k: v for k, v in overrides.items() if v is not None}
    if overrides.get("head_dim", 0) is None:
        overrides.pop("head_dim")
    ref = make_hf_model(tmp_path, seed=len(overrides), **overrides)
    if "_shard" in overrides:
        assert (tmp_path / "model.safetensors.index.json").is_file()
    prompt = np.random.default_rng(7).integers(0, TINY["vocab_size"], size=150)
    ours = run_ours(tmp_path, prompt, [150])
    want = hf_logits(ref, prompt)
    err = rel_l2_rows(ours, want)
    assert err.max() < 2e-2, err.max()
    agree = (ours.argmax(-1) == want.argmax(-1)).mean()
    assert agree > 0.95, agree


def test_bad_checkpoints_name_the_problem(tmp_path: Path) -> None:
    make_hf_model(tmp_path, seed=4)
    config_path = tmp_path / "config.json"
    raw = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**raw, "num_hidden_layers": 4}))
    with pytest.raises(WeightsError, match=r"model\.layers\.3\.input_layernorm\.weight"):
        load_weights(tmp_path, ModelConfig.from_dir(tmp_path))
    config_path.write_text(json.dumps({**raw, "intermediate_size": 128}))
    with pytest.raises(WeightsError, match=r"gate_proj.*shape"):
        load_weights(tmp_path, ModelConfig.from_dir(tmp_path))
    config_path.write_text(
        json.dumps({**raw, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    )
    with pytest.raises(ModelConfigError, match="GPT2LMHeadModel"):
        ModelConfig.from_dir(tmp_path)
    config_path.write_text(
        json.dumps({**raw, "rope_scaling": {"rope_type": "proportional", "factor": 4.0}})
    )
    with pytest.raises(ModelConfigError, match="'proportional' is not supported"):
        ModelConfig.from_dir(tmp_path)
