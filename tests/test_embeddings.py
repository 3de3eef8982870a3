"""Embeddings (SamplingParams.embed, Engine.embed): the final norm's output at a prompt's
last token, against transformers' last hidden state on the same weights (Llama and
Qwen3), and bit-identical however the prompt is computed: fresh or from cached blocks,
in one chunk or many, alone or in a step with decodes and drafts, asked again as an exact
repeat (which must still compute its last token)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_model_reference import make_hf_model
from test_qwen2 import cupy_kind  # noqa: F401 (a fixture)

from reprise.daemon import Engine, SamplingParams
from reprise.daemon.model.safetensors_io import load_safetensors
from reprise.daemon.model.synth import write_tokenizer

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

BS = 16


def engine(path: Path, **kwargs) -> Engine:
    kwargs.setdefault("num_device_blocks", 64)
    return Engine.from_pretrained(path, backend="numpy", block_size=BS, **kwargs)


def hf_last_hidden(model, prompt: list[int]) -> np.ndarray:
    with torch.no_grad():
        out = model.model(torch.tensor([prompt], dtype=torch.long))
    return out.last_hidden_state[0, -1].numpy()


def bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint32)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("embed-llama")
    model = make_hf_model(path, seed=11)
    write_tokenizer(path, 300)
    return path, model


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("embed-qwen3")
    torch.manual_seed(12)
    config = transformers.Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
                                      max_position_embeddings=512, tie_word_embeddings=True)  # fmt: skip
    model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():  # widened as test_model_reference's
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else p.copy_(1 + 0.2 * torch.randn_like(p))
    model = model.to(torch.bfloat16)
    model.save_pretrained(path)
    write_tokenizer(path, 300)
    return path, model.float().eval()


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_embeddings_match_transformers_last_hidden_state(request, family: str) -> None:
    path, model = request.getfixturevalue(family)
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, 300, n).tolist() for n in (1, 17, 90)]
    got = engine(path).embed(prompts)
    for prompt, ours in zip(prompts, got, strict=True):
        want = hf_last_hidden(model, prompt)
        assert ours.dtype == np.float32 and ours.shape == want.shape
        assert np.linalg.norm(ours - want) / np.linalg.norm(want) < 2e-2
        # the last token's row, not another's: the one before it is far
        before = hf_last_hidden(model, prompt[:-1]) if len(prompt) > 1 else -want
        assert np.linalg.norm(ours - before) / np.linalg.norm(want) > 0.1


EMBED = SamplingParams(max_tokens=1, temperature=0, detokenize=False, embed=True)


def test_an_embedding_keeps_its_bits_however_it_is_computed(llama) -> None:
    path, _ = llama
    rng = np.random.default_rng(5)
    shared = rng.integers(0, 300, 70).tolist()
    prompt = shared + rng.integers(0, 300, 10).tolist()  # 5 full blocks
    fresh = engine(path, enable_reuse=False).embed([prompt])[0]
    eng = engine(path, logits_cache_mb=0)  # no exact repeats: the last token recomputed
    eng.embed([[*shared, 7, 8, 9]])  # caches the shared prefix's blocks
    reused = eng.generate([prompt], EMBED)[0]
    assert reused.cached_tokens == 64
    assert np.array_equal(bits(reused.embedding), bits(fresh))
    chunked = engine(path, enable_reuse=False, max_num_batched_tokens=13).embed([prompt])[0]
    assert np.array_equal(bits(chunked), bits(fresh))
    batch = engine(path).embed([shared, prompt, prompt[:40]])
    assert np.array_equal(bits(batch[1]), bits(fresh))
    again = eng.generate([prompt], EMBED)[0]  # every token cached but the last, recomputed
    assert again.cached_tokens == 79
    assert np.array_equal(bits(again.embedding), bits(fresh))
    stored = engine(path)  # the default: an exact repeat from the stored embedding
    stored.embed([prompt])
    repeat = stored.generate([prompt], EMBED)[0]
    assert repeat.cached_tokens == 80 and stored.scheduler.num_exact_repeats == 1
    assert np.array_equal(bits(repeat.embedding), bits(fresh))


def test_an_embedding_is_an_exact_repeat_only_once_stored(llama) -> None:
    """A prompt's stored logits row alone (from generation) does not serve an embedding;
    once the embedding is stored beside it, a repeat takes both with no forward step."""
    path, _ = llama
    prompt = np.random.default_rng(6).integers(0, 300, 48).tolist()  # 3 full blocks
    eng = engine(path, logits_cache_mb=8)
    plain = SamplingParams(max_tokens=1, temperature=0)
    eng.generate([prompt], plain)
    eng.generate([prompt], plain)  # from the stored row: an exact repeat
    repeats = eng.scheduler.num_exact_repeats
    assert repeats == 1
    [embedding] = eng.embed([prompt])
    assert eng.scheduler.num_exact_repeats == repeats  # no embedding stored: computed
    assert np.array_equal(bits(embedding), bits(engine(path).embed([prompt])[0]))
    # now it is stored beside the logits row: an exact repeat, no forward step
    computed = eng.prefill_tokens_computed
    [again] = eng.embed([prompt])
    assert eng.scheduler.num_exact_repeats == repeats + 1
    assert eng.prefill_tokens_computed == computed
    assert np.array_equal(bits(again), bits(embedding))
    # another namespace (cache salt) never meets it: computed, the same bits
    salted = eng.embed([prompt], cache_salt="tenant-b")[0]
    assert eng.scheduler.num_exact_repeats == repeats + 1
    assert np.array_equal(bits(salted), bits(embedding))


def test_generation_with_embed_gives_both_unchanged(llama) -> None:
    path, _ = llama
    prompt = np.random.default_rng(7).integers(0, 300, 33).tolist()
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, return_logits=True)
    plain = engine(path).generate([prompt], params)[0]
    both = engine(path).generate([prompt], SamplingParams(**{**_fields(params), "embed": True}))[0]
    assert both.token_ids == plain.token_ids and plain.embedding is None
    assert np.array_equal(bits(both.logits), bits(plain.logits))
    assert np.array_equal(bits(both.embedding), bits(engine(path).embed([prompt])[0]))


def test_an_embedding_in_a_step_with_decodes_and_drafts(llama) -> None:
    """Rows are found after other requests' draft rows: an embedding asked while a
    drafting request decodes, in the same step, is the one asked alone."""
    path, _ = llama
    rng = np.random.default_rng(8)
    repetitive = rng.integers(4, 250, 19).tolist() * 3  # prompt lookup finds drafts in it
    prompt = rng.integers(0, 300, 25).tolist()
    alone = engine(path).embed([prompt])[0]
    # no exact repeats: each embedding computed, in the step with the drafts
    eng = engine(path, speculative_tokens=4, prompt_lookup_min=1, logits_cache_mb=0)
    assert eng.speculator is not None
    eng.add_request(repetitive, SamplingParams(max_tokens=300, temperature=0, ignore_eos=True))
    eng.step()
    drafted = 0
    for _ in range(40):
        before = eng.speculator.num_draft_tokens
        asked = eng.add_request(prompt, EMBED)
        eng.step()  # the embedding's prompt and the decode (maybe drafted) in one step
        assert np.array_equal(bits(eng.take_completion(asked).embedding), bits(alone))
        drafted += eng.speculator.num_draft_tokens > before
    assert drafted >= 3


def test_embed_is_checked() -> None:
    with pytest.raises(ValueError, match="embed must be a bool; got 1"):
        SamplingParams(embed=1)  # type: ignore[arg-type]


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__dataclass_fields__}


def test_a_bare_models_checkpoint_gives_the_same_embeddings(qwen3, tmp_path: Path) -> None:
    """transformers' Qwen3Model saved alone (an embedding model's checkpoint: tensors
    without `model.`, no lm_head, architectures ["Qwen3Model"]) loads, and gives the
    embeddings of the whole model it came from, bit for bit."""
    path, model = qwen3
    model.model.to(torch.bfloat16).save_pretrained(tmp_path)
    model.model.float()
    write_tokenizer(tmp_path, 300)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Qwen3Model"]
    names = set(load_safetensors(tmp_path / "model.safetensors"))
    assert "embed_tokens.weight" in names and not any(n.startswith("model.") for n in names)
    prompts = [np.random.default_rng(9).integers(0, 300, n).tolist() for n in (5, 33)]
    bare, whole = engine(tmp_path).embed(prompts), engine(path).embed(prompts)
    for a, b in zip(bare, whole, strict=True):
        assert np.array_equal(bits(a), bits(b))


def test_the_gpu_backend_gives_the_same_embeddings(
    cupy_kind: str,  # noqa: F811 (the fixture)
    tmp_path: Path,
) -> None:
    """CupyBackend (the emulated CuPy here; a device under -m gpu): embeddings within 4
    BF16 ulps of NumPy's (each row's largest), and bit-identical with decode graphs on or
    off (an embedding's step never replays one), fresh or from cached blocks."""
    from reprise.cuda.cupy_backend import CupyBackend
    from reprise.daemon.engine.engine import model_fingerprint
    from reprise.daemon.model.config import ModelConfig
    from reprise.daemon.model.llama import LlamaModel
    from reprise.daemon.model.synth import synth_model
    from reprise.daemon.model.tokenizer import Tokenizer
    from reprise.daemon.model.weights import load_weights

    folder = synth_model("tiny-qwen3", tmp_path / "q3", seed=5)  # head_dim 64
    config = ModelConfig.from_dir(folder)
    weights = load_weights(folder, config)
    rng = np.random.default_rng(10)
    shared = rng.integers(0, 1024, 40).tolist()
    prompts = [shared + rng.integers(0, 1024, 9).tolist(), rng.integers(0, 1024, 20).tolist()]
    want = engine(folder).embed(prompts)
    got = []
    for graphs in (False, True):
        eng = Engine(config, Tokenizer.from_dir(folder), LlamaModel(config, weights, CupyBackend()),
                     block_size=BS, num_device_blocks=16, cuda_graphs=graphs,
                     model_fingerprint=model_fingerprint(folder))  # fmt: skip
        eng.embed([[*shared, 1, 2, 3]])  # the shared prefix's blocks, cached
        done = eng.generate(prompts, [EMBED, EMBED])
        assert done[0].cached_tokens == 32
        got.append([d.embedding for d in done])
    fresh = Engine(config, Tokenizer.from_dir(folder), LlamaModel(config, weights, CupyBackend()),
                   block_size=BS, num_device_blocks=16, enable_reuse=False,
                   model_fingerprint=model_fingerprint(folder)).embed(prompts)  # fmt: skip
    for eager, graphed, alone, ref in zip(*got, fresh, want, strict=True):
        assert np.array_equal(bits(eager), bits(graphed))
        assert np.array_equal(bits(eager), bits(alone))
        assert np.max(np.abs(eager - ref)) / np.max(np.abs(ref)) < 4 * 2.0**-8


def test_the_command_line_prints_the_engines_embeddings(llama, tmp_path: Path) -> None:
    """`reprise embed`: one JSON line a text (arguments, then --file lines), each the
    engine's row normalized as /v1/embeddings normalizes it (float64 sum, one rounding),
    or the row itself with --raw; --dimensions keeps the first values."""
    import json
    import subprocess
    import sys

    path, _ = llama
    texts = ["hello there", "a second text", "hello there again"]
    reference = Engine.from_pretrained(path, backend="numpy")  # the CLI's settings
    rows = reference.embed([reference.tokenizer.encode(t) for t in texts])
    (tmp_path / "more.txt").write_text(texts[2] + "\n")
    cli = [sys.executable, "-m", "reprise.cli.main", "embed", "--model", str(path),
           "--backend", "numpy"]  # fmt: skip

    def run(*args: str) -> list[np.ndarray]:
        done = subprocess.run([*cli, *args], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        lines = [json.loads(line) for line in done.stdout.splitlines()]
        assert [line["index"] for line in lines] == list(range(len(lines)))
        return [np.asarray(line["embedding"], np.float32) for line in lines]

    unit = run(texts[0], texts[1], "--file", str(tmp_path / "more.txt"))
    for got, row in zip(unit, rows, strict=True):
        wide = row.astype(np.float64)
        assert np.array_equal(got, (wide / np.sqrt(np.dot(wide, wide))).astype(np.float32))
    raw = run(texts[0], "--raw", "--dimensions", "5")
    assert np.array_equal(raw[0], rows[0][:5])
    done = subprocess.run([*cli, "--dimensions", "100000", "x"], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 2 and "--dimensions must be at most" in done.stderr
