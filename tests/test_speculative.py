"""Prompt lookup speculation (daemon/engine/speculative.py) on a tiny random Llama and
the NumPy backend: drafts are the latest longest n-gram match, and whatever the drafts
(found, or planted right or wrong at every offset), tokens, text, logits, logprobs and
finish reasons are bit-identical to decoding one token a step, with no block leaked."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from reprise.cuda.dtypes import BF16
from reprise.daemon import Completion, Engine, SamplingParams, StructuredOutput
from reprise.daemon.engine.config import EngineConfig, SettingError
from reprise.daemon.engine.sequence import Sequence
from reprise.daemon.engine.speculative import Speculator, find_draft
from reprise.daemon.model.synth import synth_model

BS = 16
GREEDY = SamplingParams(
    max_tokens=40, temperature=0, ignore_eos=True, return_logits=True, logprobs=3
)
SEEDED = SamplingParams(
    max_tokens=40, temperature=0.9, top_k=50, top_p=0.95, seed=7, ignore_eos=True,
    return_logits=True, logprobs=2,
)  # fmt: skip


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield synth_model("tiny", tmp_path_factory.mktemp("spec") / "tiny")


def engine(path: Path, **kwargs) -> Engine:
    kwargs.setdefault("num_device_blocks", 64)
    return Engine.from_pretrained(path, backend="numpy", block_size=BS, **kwargs)


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(3)
    base = rng.integers(4, 250, size=19).tolist()
    return [base * 3, rng.integers(4, 250, size=29).tolist(), base[:7] * 5]


def assert_identical(got: list[Completion], want: list[Completion]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert g.text == w.text and g.finish_reason == w.finish_reason
        assert (g.logits is None) == (w.logits is None)
        if g.logits is not None:
            assert np.array_equal(g.logits.view(np.uint32), w.logits.view(np.uint32))
        assert g.logprobs == w.logprobs  # exact floats, exact top lists


def brute_draft(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The definition, spelled out: the longest suffix (hi down to lo tokens) seen
    before, its latest earlier occurrence, the k tokens after it."""
    n = len(tokens)
    for length in range(min(hi, n - 1), lo - 1, -1):
        suffix = tokens[n - length :]
        for end in range(n - 2, length - 2, -1):
            if tokens[end - length + 1 : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + k]
    return []


def test_drafts_follow_the_latest_of_the_longest_matches() -> None:
    rng = np.random.default_rng(0)
    num_found = 0
    for trial in range(600):
        n = int(rng.integers(1, 60))
        tokens = rng.integers(0, 1 + trial % 5, size=n).tolist()  # few symbols: many matches
        lo = int(rng.integers(1, 4))
        hi = lo + int(rng.integers(0, 4))
        k = int(rng.integers(1, 7))
        got = find_draft(np.asarray(tokens, np.int32), k, lo, hi).tolist()
        assert got == brute_draft(tokens, k, lo, hi), (tokens, k, lo, hi)
        num_found += bool(got)
    assert 100 < num_found < 600
    # the longer match wins over a later shorter one, the later of two equal ones
    seq = [1, 2, 3, 9, 8, 2, 3, 7, 1, 2, 3]
    assert find_draft(np.asarray(seq, np.int32), 2, 1, 3).tolist() == [9, 8]
    assert find_draft(np.asarray(seq, np.int32), 2, 1, 2).tolist() == [7, 1]
    assert find_draft(np.asarray(seq, np.int32), 2, 4, 5).tolist() == []


@pytest.fixture(scope="module")
def reference(tiny: Path) -> list[Completion]:
    """Every prompt with GREEDY and with SEEDED, one token a step."""
    out = engine(tiny).generate(prompts() * 2, [GREEDY] * 3 + [SEEDED] * 3)
    assert isinstance(out, list)
    return out


def test_found_drafts_change_no_bit(tiny: Path, reference: list[Completion]) -> None:
    eng = engine(tiny, speculative_tokens=5, prompt_lookup_min=1)
    got = eng.generate(prompts() * 2, [GREEDY] * 3 + [SEEDED] * 3)
    assert isinstance(got, list)
    assert_identical(got, reference)
    stats = eng.stats()
    assert stats["spec_draft_tokens"] > stats["spec_accepted_tokens"] > 0
    eng.pool.check_integrity()
    assert eng.pool.num_free_blocks == eng.pool.num_blocks  # every block back


class Planted:
    """Drafts taken from the reference outputs, wrong from a random offset on (or
    right throughout): every place a draft can be cut is tried; a step in five none."""

    def __init__(
        self, reference: dict[tuple[int, ...], list[int]], seed: int, right: bool = False
    ) -> None:
        self.reference = reference
        self.right = right  # every draft right, and one each step
        self.rng = np.random.default_rng(seed)
        self.num_right = 0  # draft tokens planted equal to the reference's

    def __call__(self, seq: Sequence, limit: int) -> list[int]:
        done = len(seq.output_token_ids)
        truth = self.reference.get(tuple(seq.prompt_token_ids), [])[done : done + limit]
        if self.right:
            self.num_right += len(truth)
            return truth
        if self.rng.random() < 0.2:
            return []  # no draft this step: a plain decode step (a graph's, with graphs)
        wrong_at = int(self.rng.integers(0, len(truth) + 2))
        draft = [t if i < wrong_at else (t + 1) % 1024 for i, t in enumerate(truth)]
        self.num_right += min(wrong_at, len(truth))
        return draft


class PlantedSpeculator(Speculator):
    plant: Planted

    def propose(self, seq: Sequence, limit: int) -> list[int]:
        return self.plant(seq, limit)


def planted(eng: Engine, reference: list[Completion], seed: int, right: bool = False) -> Planted:
    """Make `eng`'s speculator propose `Planted` drafts of `reference`."""
    old = eng.speculator
    assert old is not None
    spec = PlantedSpeculator(
        old.num_tokens, old.ngram_min, old.ngram_max, old.vocab_size, old.max_model_len
    )
    spec.plant = Planted({tuple(r.prompt_token_ids): r.token_ids for r in reference}, seed, right)
    eng.speculator = eng.scheduler.speculator = spec
    return spec.plant


def count_steps(eng: Engine) -> list[int]:
    steps = [0]
    step = eng.step

    def counted():
        steps[0] += 1
        return step()

    eng.step = counted  # type: ignore[method-assign]
    return steps


@pytest.mark.parametrize("seed", [0, 1])
def test_planted_drafts_right_or_wrong_change_no_bit(
    tiny: Path, reference: list[Completion], seed: int
) -> None:
    greedy, seeded = reference[:3], reference[3:]
    for params, want in ((GREEDY, greedy), (SEEDED, seeded)):
        eng = engine(tiny, speculative_tokens=6)
        plant = planted(eng, want, seed)
        steps = count_steps(eng)
        got = eng.generate([r.prompt_token_ids for r in want], params)
        assert isinstance(got, list)
        assert_identical(got, want)
        stats = eng.stats()
        assert stats["spec_accepted_tokens"] == plant.num_right > 0
        assert stats["spec_draft_tokens"] > stats["spec_accepted_tokens"]
        assert steps[0] < params.max_tokens  # fewer steps than tokens
        eng.pool.check_integrity()
        assert eng.pool.num_free_blocks == eng.pool.num_blocks


def test_an_end_inside_a_kept_draft_ends_it_there(tiny: Path) -> None:
    """Drafts planted from the answer without the end reach past it: the request ends
    where decoding one token a step ends it, with the same tokens, text and reason."""
    # printable characters favoured (a constant bias keeps rows stateless), so there is text
    base = replace(GREEDY, logit_bias={t: 30.0 for t in range(32, 127)})
    prompt = prompts()[0]
    full = engine(tiny).generate(prompt, base)
    assert isinstance(full, Completion) and len(full.text) > 12
    cases = [
        dict(stop_token_ids=[full.token_ids[9]]),  # a stop token mid-draft
        dict(max_tokens=11),
        dict(stop=[full.text[7:10]]),  # a stop string
        # held back before its first place in `full` (where it was never the argmax): the
        # first row after the hold draws it
        dict(
            stop_token_ids=[full.token_ids[9]], min_tokens=full.token_ids.index(full.token_ids[9])
        ),
    ]
    for case in cases:
        params = replace(base, **case)
        alone = engine(tiny).generate(prompt, params)
        eng = engine(tiny, speculative_tokens=8)
        planted(eng, [full], seed=5, right=True)  # each draft reaches past the end
        got = eng.generate(prompt, params)
        assert isinstance(got, Completion) and isinstance(alone, Completion)
        assert_identical([got], [alone])
        assert len(got.token_ids) < base.max_tokens, case
        assert eng.stats()["spec_accepted_tokens"] > 0
        assert eng.pool.num_free_blocks == eng.pool.num_blocks


def test_the_context_bound_holds_drafts_back(tiny: Path, reference: list[Completion]) -> None:
    want = reference[0]
    limit = len(want.prompt_token_ids) + 13
    alone = engine(tiny, max_model_len=limit).generate(want.prompt_token_ids, GREEDY)
    eng = engine(tiny, max_model_len=limit, speculative_tokens=8)
    planted(eng, [want], seed=2)
    steps = count_steps(eng)
    got = eng.generate(want.prompt_token_ids, GREEDY)
    # the prompt's step gives the first token, each later one a token and its kept drafts
    accepted = eng.stats()["spec_accepted_tokens"]
    assert accepted > 0 and steps[0] == 1 + (13 - 1) - accepted
    assert isinstance(got, Completion) and isinstance(alone, Completion)
    assert got.finish_reason == "length" and len(got.token_ids) == 13
    assert_identical([got], [alone])


def test_generated_blocks_are_registered_as_without_drafts(
    tiny: Path, reference: list[Completion]
) -> None:
    """The blocks a drafted decode fills are found again by a request whose prompt is
    the answer so far, as they are after decoding one token a step."""
    want = reference[0]
    followup = want.prompt_token_ids + want.token_ids[:-1]
    cached = []
    for spec in (0, 6):
        eng = engine(tiny, speculative_tokens=spec)
        if spec:
            planted(eng, [want], seed=3)
        eng.generate(want.prompt_token_ids, GREEDY)
        again = eng.generate(followup, replace(GREEDY, max_tokens=3))
        assert isinstance(again, Completion)
        cached.append(again.cached_tokens)
        fresh = engine(tiny, enable_reuse=False).generate(followup, replace(GREEDY, max_tokens=3))
        assert_identical([again], [fresh])  # type: ignore[list-item]
    assert cached[0] == cached[1] >= (len(followup) - 1) // BS * BS > len(want.prompt_token_ids)


STATEFUL = [
    replace(GREEDY, repetition_penalty=1.2, presence_penalty=0.3),
    replace(SEEDED, frequency_penalty=0.5),
    replace(GREEDY, structured=StructuredOutput("regex", "[a-z ]{5,60}")),
]


@pytest.mark.parametrize("drafts", ["found", "planted"])
def test_rows_with_state_are_sampled_as_they_would_be_there(tiny: Path, drafts: str) -> None:
    """Penalties count the draft tokens before a row, the min_tokens hold lifts at the
    row's own count and a grammar's mask is the one after the draft before it: drafted,
    penalized, held and structured requests stay bit-identical."""
    ps = prompts()
    held = replace(GREEDY, min_tokens=20, ignore_eos=False, stop_token_ids=[3, 4])
    for params in (STATEFUL, [held] * 3):
        want = engine(tiny).generate(ps, params)
        assert isinstance(want, list)
        eng = engine(tiny, speculative_tokens=6, prompt_lookup_min=1)
        if drafts == "planted":
            planted(eng, want, seed=8)
        got = eng.generate(ps, params)
        assert isinstance(got, list)
        assert_identical(got, want)
        stats = eng.stats()
        assert stats["spec_draft_tokens"] > 0
        if drafts == "planted":
            assert stats["spec_accepted_tokens"] > 0
        assert eng.pool.num_free_blocks == eng.pool.num_blocks


@pytest.mark.parametrize("drafts", ["found", "planted"])
def test_bad_words_ban_at_a_draft_row_what_the_draft_before_it_completes(
    tiny: Path, reference: list[Completion], drafts: str
) -> None:
    """bad_words' longer sequences look at the generated tokens before a row, the draft's
    before a draft row: drafted requests with bans stay bit-identical. The sequences (the
    tiny model's byte tokenizer spells few words) are pairs and triples of the reference's
    own tokens, and one of its tokens alone, so the bans move every answer."""
    ps = prompts()
    seqs = tuple((r.token_ids[4],) for r in reference[:3])
    seqs += tuple(tuple(r.token_ids[i : i + n]) for r in reference for i, n in ((1, 2), (8, 3)))
    banned = [replace(GREEDY, bad_words=["w"]), replace(SEEDED, bad_words=["w"])]
    for params, plain in ((banned[0], reference[:3]), (banned[1], reference[3:])):
        want = engine(tiny)
        want.bad_words_ids = lambda words: seqs  # type: ignore[method-assign]
        want_out = want.generate(ps, params)
        assert isinstance(want_out, list)
        assert all(w.token_ids != p.token_ids for w, p in zip(want_out, plain, strict=True))
        eng = engine(tiny, speculative_tokens=6, prompt_lookup_min=1)
        eng.bad_words_ids = lambda words: seqs  # type: ignore[method-assign]
        if drafts == "planted":
            planted(eng, want_out, seed=9)
        got = eng.generate(ps, params)
        assert isinstance(got, list)
        assert_identical(got, want_out)
        assert eng.stats()["spec_draft_tokens"] > 0
        assert eng.pool.num_free_blocks == eng.pool.num_blocks


def test_a_grammars_forced_tokens_are_its_draft(tiny: Path) -> None:
    """Where a grammar allows one token at a time (a literal), the draft is those tokens
    (llguidance's fast-forward tokens), kept in one step each run: the same answer in
    fewer steps."""
    literal = "the answer is final, and that is all there is to it"
    spec = StructuredOutput("regex", f"[a-z]{{3}} {literal}[.!]")
    params = replace(GREEDY, structured=spec, max_tokens=80)
    prompt = prompts()[1]
    want = engine(tiny).generate(prompt, params)
    eng = engine(tiny, speculative_tokens=8)
    steps = count_steps(eng)
    got = eng.generate(prompt, params)
    assert isinstance(got, Completion) and isinstance(want, Completion)
    assert_identical([got], [want])
    assert got.finish_reason == "stop" and literal in got.text
    kept = eng.stats()["spec_accepted_tokens"]
    assert kept >= len(literal) - 8  # each step keeps its whole draft
    assert steps[0] <= len(got.token_ids) - kept


def test_drafts_fit_the_budget_after_every_running_token(
    tiny: Path, reference: list[Completion]
) -> None:
    greedy = reference[:3]
    eng = engine(tiny, speculative_tokens=8, max_num_batched_tokens=6)
    planted(eng, greedy, seed=4)
    plans, pending = [], []
    schedule = eng.scheduler.schedule

    def recorded():
        running = {seq.request_id for seq in eng.scheduler.running}
        plan = schedule()
        plans.append((running, [(item.seq.request_id, item.num_tokens, len(item.draft))
                                for item in plan.scheduled]))  # fmt: skip
        # a decoding request has its one token pending: kept draft tokens are never recomputed
        pending.extend(item.seq.num_pending_tokens for item in plan.scheduled
                       if item.seq.output_token_ids)  # fmt: skip
        return plan

    eng.scheduler.schedule = recorded  # type: ignore[method-assign]
    got = eng.generate([r.prompt_token_ids for r in greedy], GREEDY)
    assert isinstance(got, list)
    assert_identical(got, greedy)
    assert sum(1 for _, plan in plans if any(d for _, _, d in plan)) > 5
    for running, plan in plans:
        assert sum(n for _, n, _ in plan) <= 6
        assert running <= {request_id for request_id, _, _ in plan}  # drafts took no turn
    assert pending and set(pending) == {1}


def test_preemption_with_drafts_changes_no_bit(tiny: Path, reference: list[Completion]) -> None:
    greedy = reference[:3]
    params = replace(GREEDY, max_tokens=40)
    want = engine(tiny, num_device_blocks=12).generate([r.prompt_token_ids for r in greedy], params)
    eng = engine(tiny, num_device_blocks=12, speculative_tokens=6)
    planted(eng, greedy, seed=6)
    got = eng.generate([r.prompt_token_ids for r in greedy], params)
    assert isinstance(got, list) and isinstance(want, list)
    assert_identical(got, greedy)
    assert_identical(want, greedy)
    assert eng.stats()["preemptions"] > 0 and eng.stats()["spec_accepted_tokens"] > 0
    eng.pool.check_integrity()


def test_the_padded_decode_path_mixes_with_drafted_steps(
    tiny: Path, reference: list[Completion]
) -> None:
    """With decode graphs (the padded static steps, on NumPy too), a step with a draft
    runs in a drafted bucket (padding sequences after its rows) and the others in the
    decode buckets: the same bits."""
    eng = engine(tiny, cuda_graphs=True, speculative_tokens=5, prompt_lookup_min=1)
    got = eng.generate(prompts() * 2, [GREEDY] * 3 + [SEEDED] * 3)
    assert isinstance(got, list)
    assert_identical(got, reference)
    decode = eng.runner.decode
    assert decode is not None and decode.steps > decode.drafted_steps > 0
    assert eng.stats()["spec_accepted_tokens"] > 0


def test_drafts_stop_before_a_prompt_table_id(tiny: Path) -> None:
    eng = engine(tiny, speculative_tokens=6, prompt_lookup_min=1)
    v = eng.config.vocab_size
    rng = np.random.default_rng(9)
    table = rng.standard_normal((2, eng.config.hidden_size)).astype(BF16)
    body = [5, 6, 7, v, 8, v + 1, 9]
    prompt = body * 4
    params = replace(GREEDY, max_tokens=12)
    alone = engine(tiny).generate(prompt, params, prompt_table=table)
    got = eng.generate(prompt, params, prompt_table=table)
    assert isinstance(got, Completion) and isinstance(alone, Completion)
    assert_identical([got], [alone])
    spec = eng.speculator
    assert spec is not None
    # the proposal itself, on a sequence that ends as the body's first half does
    seq = Sequence(99, prompt, params, seed=0, prompt_table=table)  # type: ignore[arg-type]
    seq.output_token_ids = [5, 6, 7]
    assert spec.propose(seq, 6) == []  # 5 6 7 is followed by a fake id at once
    seq = Sequence(100, prompt, params, seed=0, prompt_table=table)  # type: ignore[arg-type]
    seq.output_token_ids = [9, 5, 6]
    assert spec.propose(seq, 6) == [7]


@pytest.mark.parametrize(
    ("settings", "name"),
    [
        (dict(speculative_tokens=-1), "speculative_tokens"),
        (dict(speculative_tokens=33), "speculative_tokens"),
        (dict(speculative_tokens=True), "speculative_tokens"),
        (dict(prompt_lookup_min=0), "prompt_lookup_min"),
        (dict(prompt_lookup_max=65), "prompt_lookup_max"),
        (dict(prompt_lookup_min=4, prompt_lookup_max=3), "prompt_lookup_min"),
        (dict(speculative_disable_by_batch_size=0), "speculative_disable_by_batch_size"),
    ],
)
def test_bad_settings_are_refused(settings: dict, name: str) -> None:
    with pytest.raises(SettingError) as err:
        EngineConfig(**settings)
    assert err.value.name == name and name in str(err.value)


def test_a_speculator_without_room_or_a_decode_drafts_nothing(tiny: Path) -> None:
    spec = Speculator(4, 1, 3, vocab_size=1024, max_model_len=100)
    seq = Sequence(1, [1, 2, 3, 1, 2], SamplingParams(max_tokens=10), seed=0)  # type: ignore[arg-type]
    seq.num_computed_tokens = 4
    assert spec.draft(seq, 4) == []  # still in its prompt: no output yet
    seq.output_token_ids = [3]
    seq.num_computed_tokens = 5
    assert spec.draft(seq, 4) == [1, 2, 3]  # after "1 2 3": "1 2 3", then the sequence ends
    assert spec.draft(seq, 2) == [1, 2]
    assert spec.draft(seq, 0) == []
    seq.output_token_ids = [3] * 9  # max_tokens 10: one token left, which is never a draft
    seq.num_computed_tokens = 13
    assert spec.draft(seq, 4) == []


def test_vllms_speculative_config_maps_to_the_settings() -> None:
    from reprise.cli.options import speculative_config

    def fields(**config) -> tuple[int, int, int]:
        got = speculative_config(json.dumps({"method": "ngram", **config}))
        return got["speculative_tokens"], got["prompt_lookup_min"], got["prompt_lookup_max"]

    assert fields(num_speculative_tokens=3) == (3, 5, 5)  # vLLM's defaults
    assert fields(num_speculative_tokens=3, prompt_lookup_max=4) == (3, 4, 4)
    assert fields(num_speculative_tokens=2, prompt_lookup_min=2) == (2, 2, 2)
    assert fields(num_speculative_tokens=6, prompt_lookup_min=1, prompt_lookup_max=3) == (6, 1, 3)
    got = speculative_config(json.dumps({"method": "ngram", "num_speculative_tokens": 3,
                                         "disable_by_batch_size": 4}))  # fmt: skip
    assert got["speculative_disable_by_batch_size"] == 4


def test_no_drafts_while_more_requests_run_than_disable_by_batch_size(tiny: Path) -> None:
    """vLLM's disable_by_batch_size (no decode graphs here): a step drafts only while at
    most that many requests run (two of six end early), bit-identical answers."""
    params = [replace(GREEDY, max_tokens=8)] * 2 + [GREEDY] * 4
    reference = engine(tiny).generate(prompts() * 2, params)
    eng = engine(tiny, speculative_tokens=5, prompt_lookup_min=1,
                 speculative_disable_by_batch_size=4)  # fmt: skip
    plans: list[tuple[int, bool]] = []
    schedule = eng.scheduler.schedule

    def recorded():
        running = len(eng.scheduler.running)
        plan = schedule()
        plans.append((running, any(item.draft for item in plan.scheduled)))
        return plan

    eng.scheduler.schedule = recorded  # type: ignore[method-assign]
    got = eng.generate(prompts() * 2, params)
    assert isinstance(got, list) and isinstance(reference, list)
    assert_identical(got, reference)
    assert any(drafted for _, drafted in plans)
    assert not any(drafted for running, drafted in plans if running > 4)
    assert any(running > 4 for running, _ in plans)


def test_choices_of_one_prompt_are_drafted_alone(tiny: Path, reference: list[Completion]) -> None:
    """n = 3 seeded choices (seeds seed, seed + 1, seed + 2) with drafts planted from the
    first choice's answer: right for it, mostly wrong for the others; each choice is
    its own request, so all three are as without drafts."""
    params = replace(SEEDED, n=3)
    want = engine(tiny).generate(reference[3].prompt_token_ids, params)
    assert isinstance(want, list) and want[0].token_ids == reference[3].token_ids
    eng = engine(tiny, speculative_tokens=5)
    planted(eng, [want[0]], seed=9, right=True)
    got = eng.generate(reference[3].prompt_token_ids, params)
    assert isinstance(got, list)
    assert_identical(got, want)
    stats = eng.stats()
    assert stats["spec_draft_tokens"] > stats["spec_accepted_tokens"] > 0
