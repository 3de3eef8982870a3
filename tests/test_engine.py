"""The engine on the default model (SmolLM2-135M-Instruct, NumPy backend):
logits against transformers, a sensible chat answer, and the request API."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from reprise.daemon import Completion, Engine, SamplingParams

pytestmark = pytest.mark.model

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a land far away,",
    "日本の首都は",
    "1, 2, 3, 4, 5,",
]


@pytest.fixture(scope="module")
def engine(default_model_dir: Path) -> Engine:
    return Engine.from_pretrained(default_model_dir, backend="numpy")


def rel_l2(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def hf_reference(default_model_dir: Path, gguf_path: Path):
    """transformers in fp32, on our folder and independently on the source GGUF."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    load = transformers.AutoModelForCausalLM.from_pretrained
    ours = load(default_model_dir, dtype=torch.float32).eval()
    gguf = load(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32).eval()

    def logits(model, ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].numpy()

    return lambda ids: (logits(ours, ids), logits(gguf, ids))


@pytest.mark.reference
@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_and_greedy_tokens_match_transformers(
    engine: Engine, hf_reference, prompt: str
) -> None:
    steps = 8
    params = SamplingParams(max_tokens=steps, temperature=0, return_logits=True, ignore_eos=True)
    out = engine.generate(prompt, params)
    assert isinstance(out, Completion) and out.logits is not None
    assert out.logits.shape == (steps, engine.config.vocab_size) and out.logits.dtype == np.float32
    n = len(out.prompt_token_ids)
    on_folder, on_gguf = hf_reference(out.prompt_token_ids + out.token_ids)
    # Our activations are rounded to BF16 after every op, transformers' stay fp32: a
    # flipped rounding anywhere moves the logits by about 1e-2 (transformers' own BF16
    # path lands 0.005-0.046 here), while a wrong op moves them by 0.3 and more.
    assert rel_l2(out.logits[0], on_folder[n - 1]) <= 3e-2
    assert rel_l2(out.logits[0], on_gguf[n - 1]) <= 3e-2
    # teacher-forced on our tokens: wherever the reference's top-2 margin is clear, we agree
    for step in range(steps):
        ref = on_folder[n - 1 + step]
        top2 = np.sort(ref)[-2:]
        assert out.token_ids[step] == int(np.argmax(out.logits[step]))
        if top2[1] - top2[0] > 0.5:
            assert out.token_ids[step] == int(np.argmax(ref)), step


def test_chat_answer_makes_sense(engine: Engine) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = engine.chat(messages, SamplingParams(max_tokens=40, temperature=0))
    assert "Paris" in out.text
    assert out.finish_reason == "stop"
    assert out.token_ids[-1] in engine.tokenizer.eos_token_ids  # it ended on <|im_end|>
    assert "<|im_end|>" not in out.text


def test_stop_strings_and_length(engine: Engine) -> None:
    counting = "1, 2, 3, 4, 5,"
    out = engine.generate(counting, SamplingParams(max_tokens=30, temperature=0, stop=["8"]))
    assert out.finish_reason == "stop"
    assert out.text.rstrip().endswith("7,") and "8" not in out.text
    out = engine.generate(counting, SamplingParams(max_tokens=3, temperature=0))
    assert out.finish_reason == "length" and len(out.token_ids) == 3
    eos = engine.tokenizer.encode(",", add_special_tokens=False)
    out = engine.generate(
        counting, SamplingParams(max_tokens=30, temperature=0, stop_token_ids=eos)
    )
    assert out.finish_reason == "stop" and out.token_ids[-1] == eos[0]


def test_seeded_sampling_repeats_and_batches(engine: Engine) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=42, ignore_eos=True)
    first = engine.generate("Tell me a story", params)
    again = engine.generate("Tell me a story", params)
    assert first.token_ids == again.token_ids
    other = engine.generate("Tell me a story", SamplingParams(**{**_fields(params), "seed": 43}))
    assert other.token_ids != first.token_ids
    batch = engine.generate(["Hi", "Tell me a story", [1, 2, 3]], params)
    assert isinstance(batch, list) and len(batch) == 3
    assert batch[1].prompt_token_ids == first.prompt_token_ids
    assert batch[2].prompt_token_ids == [1, 2, 3]


def test_generate_tells_a_batch_from_a_prompt_and_a_refused_batch_leaves_nothing(
    engine: Engine,
) -> None:
    """A list of ids is one prompt, a list of prompts (text, ids, prepared) a batch, as a
    tuple too; a list mixing ids with prompts, or holding a bool, is refused with one
    line, in either order, and a batch refused at a later prompt leaves none of its
    earlier requests queued or finished and no block held."""
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    one = engine.generate([5, 6, 7], params)
    assert isinstance(one, Completion) and one.prompt_token_ids == [5, 6, 7]
    assert isinstance(engine.generate((5, 6, 7), params), Completion)
    prepared = engine.prepare_prompt([5, 6, 7])
    batch = engine.generate(([5, 6, 7], "Hi", prepared), params)
    assert [c.prompt_token_ids for c in batch][::2] == [[5, 6, 7], [5, 6, 7]]
    assert [c.token_ids for c in batch][::2] == [one.token_ids] * 2
    free = engine.pool.num_free_blocks
    for bad in ([5, "Hi"], ["Hi", 5], [True, 5], [5, True], [[5, 6], 7], ["Hi", [5, True]]):
        with pytest.raises(ValueError, match="prompt") as refused:
            engine.generate(bad, params)
        assert "\n" not in str(refused.value), bad
        assert not engine.has_work() and not engine._finished, bad
        assert engine.pool.num_free_blocks == free, bad


def _fields(params: SamplingParams) -> dict:
    return {name: getattr(params, name) for name in params.__slots__}


def test_small_pool_preempts_and_every_request_finishes(default_model_dir: Path) -> None:
    # 6 blocks of 16 tokens: three requests of ~40 tokens cannot all hold their blocks at once
    engine = Engine.from_pretrained(
        default_model_dir,
        backend="numpy",
        block_size=16,
        num_device_blocks=6,
        max_num_batched_tokens=24,
    )
    prompts = ["Count from one to ten:", "Name three colours:", "The alphabet starts with"]
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    outs = engine.generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == [30, 30, 30]
    assert all(o.finish_reason == "length" for o in outs)
    assert engine.pool.num_free_blocks == 6  # nothing leaked
    engine.pool.check_integrity()


@pytest.mark.parametrize(
    ("prompt", "kwargs", "message"),
    [
        ("", {}, "prompt is empty"),
        ([], {}, "prompt is empty"),
        ([5, 10**6], {}, r"token ids must be in \[0, 49152\)"),
        ("x " * 9000, {}, "context holds 8192"),
        (3.5, {}, "prompt must be a string or a list of token ids"),
    ],
)
def test_bad_prompts_raise_value_errors(engine: Engine, prompt, kwargs, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        engine.generate(prompt, SamplingParams(**kwargs))
    assert not engine.scheduler.has_work()


def test_backend_choice(default_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="backend must be one of"):
        Engine.from_pretrained(default_model_dir, backend="tpu")
    from reprise.cuda.backend import cuda_device_available

    if not cuda_device_available():
        with pytest.raises(ValueError, match="needs CuPy and a CUDA device"):
            Engine.from_pretrained(default_model_dir, backend="cupy")
        assert (
            Engine.from_pretrained(default_model_dir, num_device_blocks=4).runner.model.ops.name
            == "numpy"
        )


def test_streamed_deltas_join_to_the_text_and_never_show_a_stop_string(engine: Engine) -> None:
    params = SamplingParams(max_tokens=30, temperature=0, stop=["6, 7"])
    request_id = engine.add_request("1, 2, 3, 4, 5,", params)
    deltas, finish = [], None
    while finish is None:
        for out in engine.step():
            assert out.request_id == request_id and len(out.token_ids) == 1
            deltas.append(out.text_delta)
            finish = out.finish_reason
            assert "6, 7" not in "".join(deltas)
    done = engine.take_completion(request_id)
    assert finish == "stop" == done.finish_reason
    assert "".join(deltas) == done.text == " "  # the model went on " 6, 7": cut at the stop


def test_cancel_returns_the_blocks(engine: Engine) -> None:
    free_before = engine.pool.num_free_blocks
    keep = engine.add_request(
        "Tell me a long story", SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    )
    drop = engine.add_request(
        "Write a poem", SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    )
    for _ in range(3):
        engine.step()
    assert engine.cancel(drop) and not engine.cancel(drop)
    cancelled = engine.take_completion(drop)
    assert cancelled.finish_reason == "cancelled" and len(cancelled.token_ids) >= 2
    while engine.has_work():
        engine.step()
    assert len(engine.take_completion(keep).token_ids) == 50
    assert engine.pool.num_free_blocks == free_before
    engine.pool.check_integrity()


def test_memory_fraction_sizes_the_pool() -> None:
    from reprise.daemon.engine.config import EngineConfig

    gib = 1 << 30
    # 0.5 of 16 GiB, a tenth kept for activations: 7.2 GiB, less 1 GiB of weights
    half = EngineConfig(memory_fraction=0.5)
    assert half.device_blocks(1 << 20, 16 * gib, gib) == int(0.45 * 16 * gib - gib) >> 20
    for bad in (0, -0.1, 1.5, True, "half", float("nan")):
        with pytest.raises(ValueError, match="memory_fraction must be in"):
            EngineConfig(memory_fraction=bad)
    with pytest.raises(ValueError, match="leaves no room for KV blocks"):
        EngineConfig(memory_fraction=0.05).device_blocks(1 << 20, 16 * gib, gib)


def test_memory_fraction_on_the_numpy_backend(default_model_dir: Path) -> None:
    engine = Engine.from_pretrained(default_model_dir, backend="numpy", memory_fraction=0.3)
    ram = engine.runner.model.ops.device_memory_bytes()
    block_bytes = engine.config.kv_bytes_per_token() * engine.pool.block_size
    kv_bytes = engine.pool.num_blocks * block_bytes
    assert 0.27 * ram - engine.runner.model.num_bytes() - block_bytes < kv_bytes <= 0.27 * ram
    assert engine.runner.kv_cache.nbytes == kv_bytes
    with pytest.raises(ValueError, match="not both"):
        Engine.from_pretrained(default_model_dir, num_device_blocks=8, memory_fraction=0.3)
