"""Prompt tables (p-tuning) and extra ids through the engine, on the tiny synthetic
model with blocks of 4: TensorRT-LLM's three-request example, derived extra ids,
salts, the eager fallback of a fake last token, and every bad input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from reprise.cuda.dtypes import BF16
from reprise.cuda.embedding import embed_ref
from reprise.daemon import Engine, SamplingParams
from reprise.daemon.engine.prompt_table import check_prompt_table, row_extra_id
from reprise.daemon.model.config import ModelConfig
from reprise.daemon.model.synth import synth_model

BS = 4
GREEDY = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, return_logits=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synth_model("tiny", tmp_path_factory.mktemp("ptune") / "tiny")


@pytest.fixture(scope="module")
def config(tiny: Path) -> ModelConfig:
    return ModelConfig.from_dir(tiny)


def make(tiny: Path, **kwargs) -> Engine:
    kwargs.setdefault("num_device_blocks", 64)
    return Engine.from_pretrained(tiny, backend="numpy", block_size=BS, **kwargs)


def table(config: ModelConfig, seed: int, rows: int = 4) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((rows, config.hidden_size)).astype(BF16)


def requests(config: ModelConfig) -> list[dict]:
    """TensorRT-LLM's example (its vocabulary 100 is ours here)."""
    v = config.vocab_size
    fake = [v, v + 1, v + 2, v + 3]
    t1, t2 = table(config, 1), table(config, 2)
    return [
        dict(prompt=[*fake, 1, 2, 3, 4], prompt_table=t1, extra_ids=[1] * 4 + [0] * 4),
        dict(prompt=[*fake, 1, 2, 3, 4], prompt_table=t2, extra_ids=[2] * 4 + [0] * 4),
        dict(prompt=[*fake, 5, 6, 7, 8], prompt_table=t1, extra_ids=[1] * 4 + [0] * 4),
    ]


def run(engine: Engine, request: dict, **kwargs):
    request = {**request, **kwargs}
    out = engine.generate(request.pop("prompt"), GREEDY, **request)
    engine.pool.check_integrity()
    return out


def test_trtllm_example_shares_by_extra_ids_and_matches_a_fresh_engine(tiny, config) -> None:
    engine = make(tiny)
    r1, r2, r3 = requests(config)
    out1, out2, out3 = run(engine, r1), run(engine, r2), run(engine, r3)
    assert out1.cached_tokens == 0
    assert out2.cached_tokens == 0  # same ids, other table: no block in common
    assert out3.cached_tokens == BS  # request 1's first block
    assert not np.array_equal(out1.logits, out2.logits)
    for request, out in ((r1, out1), (r2, out2), (r3, out3)):
        fresh = run(make(tiny), request)
        assert fresh.cached_tokens == 0
        assert np.array_equal(out.logits, fresh.logits)
        assert out.token_ids == fresh.token_ids


def test_fake_ids_read_the_table_rows(tiny, config) -> None:
    """A fake id embeds as its table row: a table holding the embeddings of some text
    tokens gives exactly the logits of those text tokens."""
    engine = make(tiny, enable_reuse=False)
    text = [7, 8, 9, 10, 11, 12]
    rows = engine.runner.model.embed_tokens[np.array([8, 10])]
    v = config.vocab_size
    with_table = run(engine, {"prompt": [7, v, 9, v + 1, 11, 12], "prompt_table": rows})
    assert np.array_equal(with_table.logits, run(engine, {"prompt": text}).logits)


def test_derived_extra_ids_share_equal_tables_only(tiny, config) -> None:
    engine = make(tiny)
    v = config.vocab_size
    prompt = [v, v + 1, v + 2, v + 3, 1, 2, 3, 4, 5]
    t1 = table(config, 1)
    first = run(engine, {"prompt": prompt, "prompt_table": t1})
    same = run(engine, {"prompt": prompt, "prompt_table": t1.copy()})
    assert (first.cached_tokens, same.cached_tokens) == (0, 2 * BS)
    assert np.array_equal(first.logits, same.logits)
    for row, num_cached in ((0, 0), (3, 3)):  # row 3: a partial hit on the 3 rows before it
        changed = t1.copy()
        changed[row, 17] = changed[row, 17] + BF16.type(1.0)
        other = run(engine, {"prompt": prompt, "prompt_table": changed})
        assert other.cached_tokens == num_cached
        fresh = run(make(tiny), {"prompt": prompt, "prompt_table": changed})
        assert np.array_equal(other.logits, fresh.logits)
        assert not np.array_equal(other.logits, first.logits)


def test_derived_extra_ids_are_row_digests(config) -> None:
    v, t1 = config.vocab_size, table(config, 1)
    checked = check_prompt_table([v + 2, 5, v + 2, v], t1, None, vocab_size=v,
                                 hidden_size=config.hidden_size)  # fmt: skip
    assert checked is not None
    assert checked.extra_ids == [row_extra_id(t1[2]), 0, row_extra_id(t1[2]), row_extra_id(t1[0])]
    assert all(e > 0 for e in checked.extra_ids[::2])


def test_salts_still_isolate(tiny, config) -> None:
    engine = make(tiny)
    r1 = requests(config)[0]
    assert run(engine, r1, cache_salt="a").cached_tokens == 0
    assert run(engine, r1, cache_salt="b").cached_tokens == 0
    assert run(engine, r1, cache_salt="a").cached_tokens == 8  # an exact repeat: every token


def test_text_blocks_of_a_tabled_request_are_shared_with_plain_ones(tiny, config) -> None:
    """All-text blocks key as without a table (extra ids all 0 are no extra ids)."""
    engine = make(tiny)
    v = config.vocab_size
    plain = run(engine, {"prompt": [1, 2, 3, 4, 5, 6]})
    tabled = run(engine, {"prompt": [1, 2, 3, 4, v, 6], "prompt_table": table(config, 1, 1)})
    assert (plain.cached_tokens, tabled.cached_tokens) == (0, BS)


def test_a_fake_last_token_after_a_hit_runs_eagerly_and_matches(tiny, config) -> None:
    """A cached prefix leaves the prompt's last (fake) token to a one-token step, the
    shape of a decode step: the static decode path refuses it (it has no table rows)."""
    v = config.vocab_size
    t1 = table(config, 1)
    prompt = [1, 2, 3, 4, v + 1]
    engine = make(tiny, cuda_graphs=True)
    run(engine, {"prompt": [*prompt[:4], 9]})
    out = run(engine, {"prompt": prompt, "prompt_table": t1})
    assert out.cached_tokens == BS
    assert engine.runner.decode is not None
    assert np.array_equal(out.logits, run(make(tiny), {"prompt": prompt,
                                                       "prompt_table": t1}).logits)  # fmt: skip


def test_embed_ref_reads_prompt_rows(rng: np.random.Generator) -> None:
    vocab_rows = rng.standard_normal((10, 6)).astype(BF16)
    prompt_rows = rng.standard_normal((3, 6)).astype(BF16)
    ids = np.array([2, 10, 12, 0, 11], dtype=np.int32)
    out = embed_ref(vocab_rows, ids, prompt_rows)
    want = np.concatenate([vocab_rows, prompt_rows])[ids].astype(np.float32)
    assert np.array_equal(out, want)


@pytest.mark.parametrize(
    ("prompt", "kwargs", "match"),
    [
        ("fake", {}, r"token ids must be in \[0, 1024\); got 1024: .* no prompt_table"),
        ("fake", {"extra_ids": [1, 1, 0]}, "no prompt_table"),
        ("past", {"prompt_table": "t1"}, r"prompt_table: token id \d+ selects row 4"),
        ("fake", {"prompt_table": "wide"}, r"prompt_table must have shape \[num_virtual >= 1"),
        ("fake", {"prompt_table": "f32"}, "prompt_table must be bfloat16"),
        ("fake", {"prompt_table": "list"}, "prompt_table must be a NumPy array"),
        ("fake", {"prompt_table": "t1", "extra_ids": [1, 1]}, "extra_ids must have one id per"),
        ("fake", {"prompt_table": "t1", "extra_ids": [1, 0, 0]}, r"extra_ids\[1\] is 0"),
        ("fake", {"prompt_table": "t1", "extra_ids": [1, 1, 5]}, r"extra_ids\[2\] is 5"),
        ("fake", {"prompt_table": "t1", "extra_ids": [1, 1, -1]}, r"extra_ids\[2\] must be in"),
        ("fake", {"prompt_table": "t1", "extra_ids": [1, 1, "0"]}, r"extra_ids\[2\] must be an"),
    ],
)
def test_bad_input_names_the_field(tiny, config, prompt, kwargs, match) -> None:
    v = config.vocab_size
    prompts = {"fake": [v, v + 1, 3], "past": [v, v + 4, 3]}
    tables = {
        "t1": table(config, 1),
        "wide": np.zeros((4, config.hidden_size + 1), dtype=BF16),
        "f32": np.zeros((4, config.hidden_size), dtype=np.float32),
        "list": [[0.0] * config.hidden_size],
    }
    if "prompt_table" in kwargs:
        kwargs = {**kwargs, "prompt_table": tables[kwargs["prompt_table"]]}
    engine = make(tiny)
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompts[prompt], GREEDY, **kwargs)
    assert not engine.has_work()
