"""Decode steps at padded bucket sizes (daemon/engine/graphs.py): the path CUDA graphs replay
on the GPU backend, run eagerly on NumPy. A sequence's tokens and logits must be
bit-identical to the eager unpadded steps, whatever the bucket, the padding and the
stale rows a shrinking batch leaves behind."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from gpu_support import needs_gpu

from reprise.daemon import Engine, SamplingParams
from reprise.daemon.engine import graphs as graphs_module
from reprise.daemon.engine.graphs import DEFAULT_BUCKETS, MAX_DRAFTED_SEQS, StaticDecode
from reprise.daemon.model.llama import ForwardBatch
from reprise.daemon.model.synth import SHAPES, synth_model

BACKENDS = [
    "numpy",
    pytest.param(
        "cupy",
        marks=[
            pytest.mark.gpu,
            needs_gpu,
        ],
    ),
]


# "tiny" with head dim 64, the smallest the GPU's attention kernels take
SHAPE = {**SHAPES["tiny"], "hidden_size": 256, "num_attention_heads": 4, "head_dim": 64}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(SHAPES, "tiny-d64", SHAPE)
        yield synth_model("tiny-d64", tmp_path_factory.mktemp("graphs") / "tiny")


def engine(path: Path, backend: str, graphs: bool, **kwargs) -> Engine:
    kwargs.setdefault("num_device_blocks", 96)
    kwargs.setdefault("block_size", 16)
    return Engine.from_pretrained(path, backend=backend, cuda_graphs=graphs, **kwargs)


def traffic(rng: np.random.Generator, n: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """n requests of random lengths, greedy and seeded, finishing at different steps."""
    prompts = [rng.integers(4, 1000, size=int(rng.integers(1, 70))).tolist() for _ in range(n)]
    params = [
        SamplingParams(
            max_tokens=int(rng.integers(1, 24)),
            temperature=0.0 if i % 3 else 0.9,
            top_k=50,
            seed=100 + i,
            ignore_eos=True,
            return_logits=True,
        )
        for i in range(n)
    ]
    return prompts, params


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_requests", [1, 3, 6, 11])
def test_padded_decode_is_bit_identical_to_eager(
    tiny: Path, rng: np.random.Generator, backend: str, num_requests: int
) -> None:
    prompts, params = traffic(rng, num_requests)
    eager = engine(tiny, backend, graphs=False)
    padded = engine(tiny, backend, graphs=True)
    want = eager.generate(prompts, params)
    got = padded.generate(prompts, params)
    decode = padded.runner.decode
    assert eager.runner.decode is None and decode is not None
    assert decode.steps > 0, "no step went through the static decode path"
    # the batch shrinks as requests finish: every bucket from the first one down was used
    first = min(b for b in DEFAULT_BUCKETS if b >= num_requests)
    assert max(decode.built_buckets()) == first
    for g, w, p in zip(got, want, params, strict=True):
        assert g.token_ids == w.token_ids
        assert g.logits is not None and w.logits is not None
        assert np.array_equal(g.logits.view(np.uint32), w.logits.view(np.uint32))
        if p.greedy:  # chosen on the device from the same rows
            assert g.token_ids == np.argmax(g.logits, axis=1).tolist()
    padded.pool.check_integrity()
    assert padded.stats()["used_blocks"] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_traffic_that_joins_and_leaves_mid_decode(
    tiny: Path, rng: np.random.Generator, backend: str
) -> None:
    """Requests join while others decode, so steps mix prefill (eager) and pure decode
    (static) and the buckets grow and shrink; outputs must match each request alone."""
    prompts, params = traffic(rng, 9)
    alone = engine(tiny, backend, graphs=False)
    want = [alone.generate(p, sp) for p, sp in zip(prompts, params, strict=True)]
    padded = engine(tiny, backend, graphs=True, max_num_batched_tokens=40)
    ids, finished, pending = [], {}, list(zip(prompts, params, strict=True))
    while pending or padded.has_work():
        if pending and rng.random() < 0.4:
            ids.append(padded.add_request(*pending.pop(0)))
        for out in padded.step():
            if out.finish_reason:
                finished[out.request_id] = padded.take_completion(out.request_id)
    assert padded.runner.decode is not None and padded.runner.decode.steps > 0
    for request_id, w in zip(ids, want, strict=True):
        g = finished[request_id]
        assert g.token_ids == w.token_ids
        assert np.array_equal(g.logits.view(np.uint32), w.logits.view(np.uint32))


def test_what_the_static_path_takes(tiny: Path) -> None:
    """Prefill steps, steps that do not sample and tables wider than the static ones
    run eagerly; the scratch block lies past the pool's blocks."""
    eng = engine(tiny, "numpy", graphs=True, max_model_len=64)
    decode = eng.runner.decode
    assert isinstance(decode, StaticDecode)
    assert decode.scratch_block == eng.pool.num_blocks == eng.runner.kv_cache.shape[0] - 1
    assert decode.width == 4  # 64 tokens in blocks of 16
    prefill_steps = []
    original = decode.run

    def spy(batch):
        prefill_steps.append(batch.token_ids.shape[0])
        return original(batch)

    decode.run = spy
    eng.generate([5] * 20, SamplingParams(max_tokens=3, temperature=0))
    assert prefill_steps == [1, 1]  # the prefill step ran eagerly, the two decodes did not
    with pytest.raises(ValueError, match="ascending"):
        StaticDecode(eng.runner.model, eng.runner.kv_cache, scratch_block=0, block_size=16,
                     max_blocks_per_seq=4, buckets=(4, 2))  # fmt: skip


def test_a_failed_capture_falls_back_to_eager_steps(
    tiny: Path, rng: np.random.Generator, caplog: pytest.LogCaptureFixture
) -> None:
    prompts, params = traffic(rng, 3)
    want = engine(tiny, "numpy", graphs=False).generate(prompts, params)
    eng = engine(tiny, "numpy", graphs=True)

    def broken(fn):
        raise RuntimeError("operation not permitted when stream is capturing")

    eng.runner.model.ops.capture = broken  # an instance attribute shadows the method
    try:
        got = eng.generate(prompts, params)
    finally:
        del eng.runner.model.ops.capture
    decode = eng.runner.decode
    assert decode is not None and decode.steps == 0
    assert decode.failed is not None and "stream is capturing" in decode.failed
    assert "decoding eagerly" in caplog.text
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert np.array_equal(g.logits.view(np.uint32), w.logits.view(np.uint32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_capturing_every_bucket_ahead_of_time(
    tiny: Path, rng: np.random.Generator, backend: str
) -> None:
    """`capture_decode_graphs` captures the buckets a step could need, largest first,
    touching no pool block; later steps capture nothing and their bits are unchanged."""
    prompts, params = traffic(rng, 6)
    want = engine(tiny, backend, graphs=False).generate(prompts, params)
    eng = engine(tiny, backend, graphs=True, num_device_blocks=40, kv_events=True)
    captured: list[int] = []
    original = eng.runner.model.ops.capture

    def counting(fn):
        captured.append(len(captured))
        return original(fn)

    eng.runner.model.ops.capture = counting  # an instance attribute shadows the method
    try:
        assert eng.capture_decode_graphs(max_seqs=6) == [1, 2, 4, 8]  # 6 rows need bucket 8
        assert eng.capture_decode_graphs(max_seqs=1) == [1, 2, 4, 8]  # nothing new
        # 40 blocks: at most 40 sequences, bucket 48
        assert eng.capture_decode_graphs() == [1, 2, 4, 8, 16, 24, 32, 48]
        assert len(captured) == 8
        assert eng.stats()["used_blocks"] == 0 and eng.take_events() == []
        got = eng.generate(prompts, params)
    finally:
        del eng.runner.model.ops.capture
    assert len(captured) == 8, "a step captured a bucket that was captured ahead of time"
    assert eng.runner.decode is not None and eng.runner.decode.steps > 0
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert np.array_equal(g.logits.view(np.uint32), w.logits.view(np.uint32))
    assert engine(tiny, backend, graphs=False).capture_decode_graphs() == []


def test_a_failed_capture_ahead_of_time_stops_there(
    tiny: Path, caplog: pytest.LogCaptureFixture
) -> None:
    eng = engine(tiny, "numpy", graphs=True, num_device_blocks=40)
    original, calls = eng.runner.model.ops.capture, []

    def fails_second(fn):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory allocating the graph")
        return original(fn)

    eng.runner.model.ops.capture = fails_second
    try:
        assert eng.capture_decode_graphs() == [48]  # largest first: 32 failed, nothing after
    finally:
        del eng.runner.model.ops.capture
    decode = eng.runner.decode
    assert decode is not None and "out of memory" in (decode.failed or "")
    assert len(calls) == 2 and "decoding eagerly" in caplog.text
    out = eng.generate([5] * 20, SamplingParams(max_tokens=3, temperature=0))
    assert len(out.token_ids) == 3 and decode.steps == 0  # eager from then on


def repetitive(rng: np.random.Generator, n: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """`traffic` with prompts that repeat themselves, so prompt lookup finds drafts."""
    prompts, params = traffic(rng, n)
    bases = [rng.integers(4, 1000, size=int(rng.integers(2, 9))).tolist() for _ in range(n)]
    return [(b * 12)[: len(p) + 8] for b, p in zip(bases, prompts, strict=True)], params


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("num_requests", "k", "block_size"), [(1, 3, 16), (5, 8, 16),
                                                              (20, 5, 16), (7, 6, 4)])  # fmt: skip
def test_drafted_steps_through_padded_buckets_are_bit_identical(
    tiny: Path, rng: np.random.Generator, backend: str, num_requests: int, k: int, block_size: int
) -> None:
    """Drafted steps of up to MAX_DRAFTED_SEQS sequences run in drafted buckets (the
    batch's rows, then padding sequences on the scratch block), larger ones eagerly:
    every token and logit is what decoding one token a step eagerly gives."""
    if backend == "cupy":  # the GPU's attention kernels take pages of 16 tokens and up
        block_size = max(block_size, 16)
    prompts, params = repetitive(rng, num_requests)
    want = engine(tiny, backend, graphs=False, block_size=block_size).generate(prompts, params)
    eng = engine(tiny, backend, graphs=True, block_size=block_size, speculative_tokens=k,
                 prompt_lookup_min=1)  # fmt: skip
    got = eng.generate(prompts, params)
    decode = eng.runner.decode
    assert decode is not None and decode.drafted_steps > 0
    assert max(decode.built_buckets(drafted=True)) <= MAX_DRAFTED_SEQS
    if backend == "numpy":  # the GPU's tokens are its own: one request may never repeat
        assert eng.stats()["spec_accepted_tokens"] > 0
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert np.array_equal(g.logits.view(np.uint32), w.logits.view(np.uint32))
    eng.pool.check_integrity()
    assert eng.stats()["used_blocks"] == 0


@pytest.mark.parametrize(("block_size", "max_len", "k"), [(16, 256, 5), (4, 64, 8), (64, 128, 32),
                                                         (1, 40, 3), (16, 16, 2)])  # fmt: skip
def test_drafted_padding_fills_every_row_on_the_scratch_block(
    tiny: Path, rng: np.random.Generator, block_size: int, max_len: int, k: int
) -> None:
    """Whatever the batch (sequences, drafts of 0 to K tokens), a drafted bucket's rows
    past the batch's form padding sequences of 1 to pad_cap rows on the scratch block
    alone, after the batch's own, which are copied as they are."""
    eng = engine(tiny, "numpy", graphs=True, block_size=block_size, max_model_len=max_len,
                 speculative_tokens=k)  # fmt: skip
    decode = eng.runner.decode
    assert decode is not None and decode.drafted_buckets
    assert decode.pad_cap <= decode.width * block_size
    scratch = decode.scratch_block
    for _ in range(40):
        size = int(rng.choice(decode.drafted_buckets))
        num_seqs, num_rows = decode.drafted_shape(size)
        n = int(rng.integers(1, size + 1))
        drafts = rng.integers(0, k + 1, size=n)
        lens = 1 + drafts
        starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        t = int(starts[-1])
        width = int(rng.integers(1, decode.width + 1))
        batch = ForwardBatch(
            token_ids=rng.integers(0, 100, size=t).astype(np.int32),
            positions=rng.integers(0, 100, size=t).astype(np.int32),
            slot_mapping=rng.integers(0, 100, size=t).astype(np.int64),
            block_tables=rng.integers(0, scratch, size=(n, width)).astype(np.int32),
            seq_lens=(lens + rng.integers(0, 50, size=n)).astype(np.int32),
            query_start_loc=starts,
            logit_rows=np.arange(t, dtype=np.int32),
        )
        if t == n:
            continue  # no draft: a decode bucket's step
        assert decode.fits(batch)
        wide = replace(batch, block_tables=np.zeros((n, decode.width + 1), np.int32))
        assert not decode.fits(wide)
        bucket = decode._bucket(size, drafted=True)
        assert bucket is not None and (bucket.num_seqs, bucket.num_rows) == (num_seqs, num_rows)
        columns = decode._fill(bucket, batch)
        f = bucket.host_fields
        assert np.array_equal(f.token_ids[:t], batch.token_ids)
        assert np.array_equal(f.slot_mapping[:t], batch.slot_mapping)
        assert np.array_equal(f.seq_lens[:n], batch.seq_lens)
        assert np.array_equal(f.block_tables[:n, :width], batch.block_tables)
        qsl = f.query_start_loc.copy()
        assert np.array_equal(qsl[: n + 1], starts) and qsl[-1] == num_rows
        pad_rows = np.diff(qsl[n:])
        assert pad_rows.min() >= 1 and pad_rows.max() <= decode.pad_cap
        assert np.array_equal(f.seq_lens[n:], pad_rows)  # each at positions 0 ..
        assert (f.slot_mapping[t:] == decode.scratch_slot).all()
        pages = -(-int(pad_rows.max()) // block_size)
        assert columns >= max(width, pages)
        assert (f.block_tables[n:, :pages] == scratch).all()


def test_no_drafts_while_more_requests_run_than_a_drafted_bucket_holds(
    tiny: Path, rng: np.random.Generator
) -> None:
    """With decode graphs, a step drafts only while at most MAX_DRAFTED_SEQS requests run
    (a larger drafted step would run eagerly); without graphs, at any batch size."""
    prompts, params = repetitive(rng, MAX_DRAFTED_SEQS + 6)
    for graphs in (True, False):
        eng = engine(tiny, "numpy", graphs=graphs, speculative_tokens=4, prompt_lookup_min=1,
                     num_device_blocks=160)  # fmt: skip
        plans: list[tuple[int, bool, bool]] = []  # (running, drafted, decodes only) a step
        schedule = eng.scheduler.schedule

        def recorded(schedule=schedule, eng=eng, plans=plans):
            running = len(eng.scheduler.running)
            plan = schedule()
            decodes = all(item.seq.output_token_ids for item in plan.scheduled)
            plans.append((running, any(item.draft for item in plan.scheduled), decodes))
            return plan

        eng.scheduler.schedule = recorded
        eng.generate(prompts, params)
        crowded = [drafted for running, drafted, _ in plans if running > MAX_DRAFTED_SEQS]
        assert crowded and any(drafted for _, drafted, _ in plans)
        assert any(crowded) != graphs  # drafts in crowded steps only without graphs
        if graphs:  # every drafted step that decodes only replays a drafted bucket
            decode = eng.runner.decode
            assert decode is not None
            assert decode.drafted_steps == sum(d and pure for _, d, pure in plans) > 0


def test_a_failed_drafted_capture_leaves_the_decode_graphs(
    tiny: Path, rng: np.random.Generator, caplog: pytest.LogCaptureFixture
) -> None:
    """A drafted bucket that cannot be captured (its memory, say) turns the drafted
    buckets off alone: drafted steps run eagerly, decode steps keep their graphs, and
    every bit stays."""
    prompts, params = repetitive(rng, 3)
    want = engine(tiny, "numpy", graphs=False).generate(prompts, params)
    eng = engine(tiny, "numpy", graphs=True, speculative_tokens=4, prompt_lookup_min=1)
    decode = eng.runner.decode
    assert decode is not None
    original = eng.runner.model.ops.capture

    def no_drafted(fn):
        if building[-1].num_rows > building[-1].num_seqs:  # the bucket being captured
            raise RuntimeError("out of memory capturing")
        return original(fn)

    building: list = []
    make = graphs_module._Bucket

    def tracked(*args, **kwargs):
        building.append(bucket := make(*args, **kwargs))
        return bucket

    eng.runner.model.ops.capture = no_drafted
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(graphs_module, "_Bucket", tracked)
            assert eng.capture_decode_graphs(max_seqs=4) == [1, 2, 4]
            got = eng.generate(prompts, params)
    finally:
        del eng.runner.model.ops.capture
    assert decode.failed is None and "out of memory" in (decode.drafted_failed or "")
    assert decode.drafted_buckets == () and decode.built_buckets(drafted=True) == []
    assert decode.steps > 0 and decode.drafted_steps == 0 and "drafted steps run" in caplog.text
    assert eng.stats()["spec_accepted_tokens"] > 0  # drafted, eagerly
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert np.array_equal(g.logits.view(np.uint32), w.logits.view(np.uint32))


def test_what_the_drafted_buckets_take(tiny: Path) -> None:
    """Up to MAX_DRAFTED_SEQS sequences of up to K draft rows each, every row sampling;
    without speculation no drafted step fits."""
    k = 3

    def drafted(n: int, rows_each: int, sampled: int | None = None) -> ForwardBatch:
        t = n * rows_each
        return ForwardBatch(
            token_ids=np.zeros(t, np.int32), positions=np.zeros(t, np.int32),
            slot_mapping=np.zeros(t, np.int64), block_tables=np.zeros((n, 2), np.int32),
            seq_lens=np.full(n, 40, np.int32),
            query_start_loc=np.arange(0, t + 1, rows_each, dtype=np.int32),
            logit_rows=np.arange(t if sampled is None else sampled, dtype=np.int32),
        )  # fmt: skip

    decode = engine(tiny, "numpy", graphs=True, speculative_tokens=k).runner.decode
    assert decode is not None and decode.drafted_buckets[-1] == MAX_DRAFTED_SEQS
    assert decode.fits(drafted(MAX_DRAFTED_SEQS, 1 + k))
    assert not decode.fits(drafted(MAX_DRAFTED_SEQS + 1, 2))  # runs eagerly
    assert not decode.fits(drafted(2, 2 + k))  # longer drafts than K
    assert not decode.fits(drafted(2, 3, sampled=5))  # a row that does not sample
    plain = engine(tiny, "numpy", graphs=True).runner.decode
    assert plain is not None and plain.drafted_buckets == ()
    assert plain.fits(drafted(3, 1)) and not plain.fits(drafted(3, 2))


def test_capturing_ahead_of_time_takes_the_drafted_buckets_too(tiny: Path) -> None:
    """With speculation, `capture_decode_graphs` captures the drafted buckets beside the
    decode ones, the bucket of most rows first; it still returns the decode sizes, and
    a drafted step then captures nothing."""
    eng = engine(tiny, "numpy", graphs=True, speculative_tokens=4)
    decode = eng.runner.decode
    assert decode is not None
    captured: list[int] = []
    original = eng.runner.model.ops.capture

    def counting(fn):
        captured.append(1)
        return original(fn)

    eng.runner.model.ops.capture = counting
    try:
        assert eng.capture_decode_graphs(max_seqs=6) == [1, 2, 4, 8]
        rows = [b.num_rows for b in decode._built.values()]  # in the order built
        assert rows == sorted(rows, reverse=True) and len(captured) == 8
        assert decode.built_buckets(drafted=True) == [1, 2, 4, 8]
        assert rows[0] == decode.drafted_shape(8)[1] > 8
        prompts, params = repetitive(np.random.default_rng(5), 3)
        eng.generate(prompts, params)
    finally:
        del eng.runner.model.ops.capture
    assert decode.drafted_steps > 0 and len(captured) == 8  # nothing captured on the way


def test_max_num_seqs_bounds_the_batch_and_the_graphs_captured(
    tiny: Path, rng: np.random.Generator
) -> None:
    """vLLM's max_num_seqs: never more requests running, the buckets captured ahead of
    time only those such a batch needs, and every bit as with no bound."""
    prompts, params = traffic(rng, 7)
    want = engine(tiny, "numpy", graphs=False).generate(prompts, params)
    eng = engine(tiny, "numpy", graphs=True, max_num_seqs=3)
    assert eng.capture_decode_graphs() == [1, 2, 4]  # 3 sequences: bucket 4
    running = []
    step = eng.step

    def counted():
        out = step()
        running.append(len(eng.scheduler.running))
        return out

    eng.step = counted
    got = eng.generate(prompts, params)
    assert max(running) == 3
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert np.array_equal(g.logits.view(np.uint32), w.logits.view(np.uint32))
