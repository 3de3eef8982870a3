"""The in-process engine: `Engine.from_pretrained(...)` and `engine.generate(...)`.

`step()` is three calls: `plan = scheduler.schedule()` picks the tokens and the
blocks (the pool's lookups and allocations, and the block copies they need),
`out = runner.execute(plan)` runs the copies and then the forward and samples,
and `postprocess(plan, out)` registers the blocks that became full, records the
new tokens, detokenizes them and finishes the requests that are done (by the rules
of outputs.py, which also builds what a step and a finished request hand back).

A request is checked at `add_request` (checks.py, with prompts.py and
prompt_table.py) before anything is queued; disk_tier.py opens the disk tier the
settings name; pipeline.py plans the steps asynchronous scheduling launches ahead.
"""

from __future__ import annotations

import functools
import itertools
import random
import secrets
import threading
import weakref
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from ...blockpool.events import EventQueue, KVEvent
from ...blockpool.hashing import DEFAULT_NAMESPACE, BlockHash, Namespace, encode_ids
from ...blockpool.host import HostTier
from ...blockpool.pool import BlockPool
from ...cuda.backend import get_backend
from ..model.config import ModelConfig
from ..model.fingerprint import model_fingerprint
from ..model.llama import LlamaModel
from ..model.tokenizer import IncrementalDetokenizer, Tokenizer
from ..model.weights import load_weights
from .checks import (
    check_drawable,
    check_fits,
    check_prompt_logprobs,
    check_request,
    check_settings,
    check_vocab_ids,
)
from .config import EngineConfig, SettingError
from .disk_tier import open_disk_tier
from .kvmanager import KVCacheManager
from .logits_cache import LogitsCache, embedding_key
from .outputs import completion, new_detokenizer, record_token, step_output
from .params import Completion, Retention, SamplingParams, StepOutput
from .pipeline import goes_ahead, pins, plan_ahead, without_ended
from .prompt_logprobs import PromptLogprobs, PromptLogprobStore
from .prompt_table import check_prompt_table
from .prompts import PreparedPrompt, Prompt, prompt_ids, split_batch
from .runner import Launched, ModelRunner, RunOutput
from .sampling import Grammars
from .sampling.bad_words import tokenize_bad_words
from .scheduler import Scheduler, StepPlan
from .sequence import RequestId, SeqStatus, Sequence
from .speculative import Speculator

MAX_KEPT_BAD_WORDS = 256  # requests' bad_words lists whose token sequences are kept


class Engine:
    """One model, its KV cache and block pool, and the requests running on them.

    Built from an `EngineConfig` (config.py): `settings`, with `overrides` (its
    field names) replacing fields of it, or of the defaults when it is None.
    """

    def __init__(
        self,
        config: ModelConfig,
        tokenizer: Tokenizer,
        model: LlamaModel,
        settings: EngineConfig | None = None,
        *,
        model_fingerprint: bytes = b"",
        **overrides: Any,
    ) -> None:
        settings = _settings(settings, overrides)
        self.settings = settings
        self.config = config
        self.tokenizer = tokenizer
        self.max_model_len = check_settings(settings, config)
        block_bytes = config.kv_bytes_per_token() * settings.block_size
        num_device_blocks = settings.device_blocks(
            block_bytes, model.ops.device_memory_bytes(), model.num_bytes()
        )
        num_host_blocks = settings.host_blocks(block_bytes)
        on_gpu = model.ops.name == "cupy"
        cuda_graphs = on_gpu if settings.cuda_graphs is None else settings.cuda_graphs
        self.disk_tier = open_disk_tier(settings, config, model, model_fingerprint)
        if self.disk_tier is not None:  # queued writes finish at exit at the latest
            weakref.finalize(self, self.disk_tier.close)
        self.runner = ModelRunner(
            model,
            num_device_blocks,
            settings.block_size,
            num_host_blocks,
            decode_graphs=cuda_graphs,
            max_model_len=self.max_model_len,
            disk_tier=self.disk_tier,
            keep_prompt_logits=settings.logits_cache_bytes > 0,
            draft_tokens=settings.speculative_tokens,
        )
        # kept only when asked for: nothing takes them otherwise, and a list nobody drains
        # grows with every block stored or moved
        self.events = EventQueue() if settings.kv_events else None
        self.pool = BlockPool(
            num_device_blocks,
            settings.block_size,
            enable_reuse=settings.enable_reuse,
            host_tier=HostTier(num_host_blocks) if num_host_blocks else None,
            disk_tier=self.disk_tier,
            event_sink=self.events,
            # disk hits are read straight into host slots (pinned on the GPU: no page
            # faults, and their onboard is the host tier's asynchronous copy)
            host_memory=self.runner.host_cache.__getitem__,
            # a long run of host or disk hits: their device copies start while the match goes on
            copies_ready=self._start_copies,
        )
        # prompt entries of as many blocks as the device pool and host tier hold together
        self.logprob_store = PromptLogprobStore(
            num_device_blocks + num_host_blocks,
            settings.max_prompt_logprobs,
            block_size=settings.block_size,
            disk=self.disk_tier,  # entries kept as sidecars of the blocks' files
        )
        self.kv = KVCacheManager(
            self.pool, model_fingerprint, self.logprob_store, config.shared_window
        )
        self.logits_cache = (
            LogitsCache(settings.logits_cache_bytes) if settings.logits_cache_bytes else None
        )
        self.speculator = (
            Speculator(
                settings.speculative_tokens,
                settings.prompt_lookup_min,
                settings.prompt_lookup_max,
                vocab_size=config.vocab_size,
                max_model_len=self.max_model_len,
            )
            if settings.speculative_tokens
            else None
        )
        max_drafted = settings.speculative_disable_by_batch_size
        if self.runner.decode is not None:  # a larger drafted step would run eagerly
            graphs = self.runner.decode.max_drafted_seqs
            max_drafted = graphs if max_drafted is None else min(max_drafted, graphs)
        self.scheduler = Scheduler(
            self.kv, settings.step_budget(on_gpu), self.logits_cache, self.speculator,
            max_drafted_seqs=max_drafted, max_num_seqs=settings.max_num_seqs,
        )  # fmt: skip
        self.stop_token_ids = frozenset(tokenizer.eos_token_ids) | frozenset(config.eos_token_ids)
        self.grammars = Grammars(tokenizer.backend.to_str, config.vocab_size, self.stop_token_ids)
        # bad_words' token sequences by words, for the requests that repeat them
        self._bad_words_seqs: dict[tuple[str, ...], tuple[tuple[int, ...], ...]] = {}
        self._bad_words_lock = threading.Lock()  # the tokenizing threads and the loop
        self.prefill_tokens_computed = 0
        self._next_id = itertools.count()
        # settings.seed: unseeded requests' seeds, drawn in the order they are added
        self._seeds = None if settings.seed is None else random.Random(settings.seed)
        self._detokenizers: dict[RequestId, IncrementalDetokenizer] = {}
        self._live: dict[RequestId, Sequence] = {}
        self._finished: dict[RequestId, Sequence] = {}
        # asynchronous scheduling: the step launched ahead, its tokens not yet recorded
        self._ahead: tuple[StepPlan, Launched] | None = None
        self.num_async_steps = 0  # steps launched so, before the tokens before them were read

    @classmethod
    def from_pretrained(
        cls,
        path: Path | str | None = None,
        settings: EngineConfig | None = None,
        *,
        progress: Callable[[int, int], None] | None = None,
        **overrides: Any,
    ) -> Engine:
        """Load a Hugging Face model folder or a GGUF file (converted into a folder under
        the cache the first time: prepare_gguf) from `path`, else `settings.model`; none
        means the default model, prepared (fetched and converted) first if it is missing.

        The device pool holds `num_device_blocks` blocks; or, with `memory_fraction`
        (as vLLM's gpu_memory_utilization), as many as fit in that fraction of the
        device's memory (the GPU's; the host's RAM on the NumPy backend) beside the
        weights; with neither, 1 GiB worth. Every setting is checked before loading."""
        if path is not None:
            overrides["model"] = str(path)
        settings = _settings(settings, overrides)
        if settings.model is None:
            from ..model.prepare import prepare_default_model

            folder = prepare_default_model(progress=progress is not None).path
        else:
            from ..model.prepare import is_gguf_file, prepare_gguf

            folder = Path(settings.model)
            if is_gguf_file(folder):  # llama.cpp's format: converted once into the cache
                folder = prepare_gguf(folder, progress=progress is not None).path
        ops = get_backend(settings.backend)
        if ops.name == "cupy":  # the GPU's attention kernels stage pages of these sizes
            from ...cuda.attention_kernel import BLOCK_SIZES

            if settings.block_size not in BLOCK_SIZES:
                raise SettingError(
                    "block_size",
                    f"block_size must be one of {BLOCK_SIZES} on the CuPy backend (the GPU's "
                    f"attention kernels); got {settings.block_size}",
                )
        hf_fields = settings.config_overrides()
        config = ModelConfig.from_dir(folder, settings.max_model_len, hf_fields)
        if ops.name == "cupy":  # a head the kernels lack runs padded with zeros, or not at all
            from ...cuda.cupy_backend import kernel_head_dim

            try:
                head_dim = kernel_head_dim(config.head_dim)
                if head_dim != config.head_dim:
                    config = config.padded(head_dim)
            except ValueError as e:
                raise SettingError("backend", str(e)) from None
        tokenizer = Tokenizer.from_dir(folder)
        model = LlamaModel(config, load_weights(folder, config, progress), ops)
        fingerprint = model_fingerprint(folder, config, hf_fields)
        return cls(config, tokenizer, model, settings, model_fingerprint=fingerprint)

    # -- requests ---------------------------------------------------------------------------

    def prepare_prompt(
        self,
        prompt: Prompt,
        *,
        cache_salt: str | bytes | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> PreparedPrompt:
        """`prompt` checked as `add_request` checks it (ValueError), with its ids encoded
        as block keys and, when it has no prompt-table ids, its full blocks' keys under
        `cache_salt`: the admission work that depends on the prompt alone. Safe on any
        thread (it reads the engine's fixed settings only), so a server runs it off its
        loop; `add_request` takes the result in place of the prompt (prompts.py), and
        `truncate_prompt_tokens` keeps the prompt's last that many ids, as the request's
        SamplingParams.truncate_prompt_tokens does."""
        ids, array = self._prompt_ids(prompt, truncate_prompt_tokens)
        array.flags.writeable = False
        id_bytes = encode_ids(array)  # as block keys encode them
        namespace = _namespace(cache_salt)
        keys: tuple[BlockHash, ...] = ()
        if self.pool.enable_reuse and int(array.max()) < self.config.vocab_size:
            keys = tuple(self.kv.prompt_keys(id_bytes, namespace))
        return PreparedPrompt(tuple(ids), array, id_bytes, namespace, keys, owner=self)

    def token_room(self, num_prompt_tokens: int) -> int:
        """The most tokens a request of this prompt may generate: what the context and the
        device pool (every block of it, as `check_fits` counts) hold after the prompt."""
        capacity = min(self.max_model_len, self.pool.num_blocks * self.pool.block_size)
        return capacity - num_prompt_tokens

    def bad_words_ids(self, words: list[str] | None) -> tuple[tuple[int, ...], ...]:
        """The token sequences `words` ban (sampling/bad_words.py), or ValueError when
        one is past the vocabulary; kept for the next request naming the same words, so
        a server computes them off its loop first (safe on any thread)."""
        if not words:
            return ()
        key = tuple(words)
        if (seqs := self._bad_words_seqs.get(key)) is None:
            encode = functools.partial(self.tokenizer.encode, add_special_tokens=False)
            seqs = tokenize_bad_words(key, encode)
            vocab = self.config.vocab_size
            if past := [t for seq in seqs for t in seq if t >= vocab]:
                raise ValueError(f"bad_words give tokens past the vocabulary ({vocab}): {past[:5]}")
            with self._bad_words_lock:
                if len(self._bad_words_seqs) >= MAX_KEPT_BAD_WORDS:
                    self._bad_words_seqs.pop(next(iter(self._bad_words_seqs)), None)
                self._bad_words_seqs[key] = seqs
        return seqs

    def _held_stop_ids(self, params: SamplingParams) -> frozenset[int]:
        """The vocabulary tokens that would end a request of `params`, which min_tokens
        holds back (none without min_tokens)."""
        if not params.min_tokens:
            return frozenset()
        eos = frozenset() if params.ignore_eos else self.stop_token_ids
        vocab = self.config.vocab_size
        return frozenset(t for t in eos | frozenset(params.stop_token_ids) if t < vocab)

    def _as_embedded(self, rows: np.ndarray | None) -> np.ndarray | None:
        """A prompt table's rows as the embedding's rows enter the model: times Granite's
        embedding_multiplier (folded into the embedding itself, weights.py), as
        transformers multiplies its inputs_embeds; the rows' extra ids stay the given
        rows'."""
        factor = self.config.embedding_multiplier
        if rows is None or factor == 1.0:
            return rows
        return (rows.astype(np.float32) * np.float32(factor)).astype(rows.dtype)

    def _draw_seed(self) -> int:
        """A request's seed when it gives none: fresh randomness, or the next of
        settings.seed's sequence."""
        return secrets.randbits(64) if self._seeds is None else self._seeds.getrandbits(64)

    def add_request(
        self,
        prompt: Prompt | PreparedPrompt,
        params: SamplingParams | None = None,
        *,
        cache_salt: str | bytes | None = None,
        retention: Retention | None = None,
        priority: int = 0,
        prompt_table: np.ndarray | None = None,
        extra_ids: Seq[int] | None = None,
    ) -> RequestId:
        """Queue a request. Requests with different `cache_salt` never share KV blocks.
        Lower `priority` values are admitted first (as vLLM's priority scheduling),
        equal ones in arrival order; the running request that sorts last is the one
        preempted when blocks run short.

        p-tuning (prompt_table.py): prompt ids >= the vocabulary size select rows of
        `prompt_table` ([num_virtual, hidden] BF16); `extra_ids` (one per prompt id, 0
        for text, > 0 for fake ids, equal for equal tables) keep blocks of different
        tables apart. Without them, each fake id's extra id is its row's digest.

        `prompt` may be this engine's `prepare_prompt` of it: the same request, its
        checks and keys computed before."""
        params = params or SamplingParams()
        check_request(params, priority)
        keep = params.truncate_prompt_tokens
        prepared = None
        if not isinstance(prompt, PreparedPrompt):
            prompt_ids, prompt_array = self._prompt_ids(prompt, keep)
            id_bytes = encode_ids(prompt_array)  # as block keys encode them
        else:
            prepared = prompt.checked_by(self)
            if keep is not None and len(prepared.ids) > keep:
                raise ValueError(
                    f"the prepared prompt has {len(prepared.ids)} tokens, more than "
                    f"truncate_prompt_tokens ({keep}): prepare it with truncate_prompt_tokens"
                )
            prompt_ids, prompt_array = list(prepared.ids), prepared.array
            id_bytes = prepared.id_bytes
        if keep is not None and extra_ids is not None and len(extra_ids) > len(prompt_ids):
            extra_ids = list(extra_ids)[-len(prompt_ids) :]  # they were the whole prompt's
        check_prompt_logprobs(params, prompt_table, extra_ids, self.settings.max_prompt_logprobs)
        check_vocab_ids(params, self.config.vocab_size)
        table = check_prompt_table(
            prompt_array,
            prompt_table,
            extra_ids,
            vocab_size=self.config.vocab_size,
            hidden_size=self.config.hidden_size,
        )
        check_fits(len(prompt_ids), params, self.max_model_len, self.pool)
        bad_words, stop_ids = self.bad_words_ids(params.bad_words), self._held_stop_ids(params)
        check_drawable(params, bad_words, stop_ids)
        grammar = None if params.structured is None else self.grammars.start(params.structured)
        request_id = RequestId(next(self._next_id))
        seed = params.seed if params.seed is not None else self._draw_seed()
        namespace = _namespace(cache_salt)
        seq = Sequence(
            request_id,
            prompt_ids,
            params,
            seed,
            namespace=namespace,
            retention=retention,
            priority=int(priority),
            prompt_table=None if table is None else self._as_embedded(table.table),
            prompt_extra_ids=None if table is None else table.extra_ids,
            prompt_id_bytes=id_bytes,
            stop_ids=stop_ids,
            grammar=grammar,
            bad_words=bad_words,
        )
        if prepared is not None:  # its keys, when they are this request's
            seq.hash_chain = prepared.keys_for(namespace, table is not None)
        if params.prompt_logprobs is not None:
            seq.prompt_logprobs = PromptLogprobs.build(
                params.prompt_logprobs,
                prompt_ids,
                self.pool.block_size,
                self.settings.max_prompt_logprobs,
            )
        if (detok := new_detokenizer(seq, self.tokenizer)) is not None:
            self._detokenizers[request_id] = detok
        self.scheduler.add(seq)
        self._live[request_id] = seq
        return request_id

    def add_choices(
        self, prompt: Prompt | PreparedPrompt, params: SamplingParams | None = None, **options: Any
    ) -> list[RequestId]:
        """Queue `params.n` completions of one prompt (`add_request`'s keywords apply to
        each), choice i with `params.choice(i)`. They are requests of their own: the
        first computes the prompt's full blocks, and the scheduler holds the others
        until it has (blocks in flight), so they reuse them rather than compute them
        again. The choices differ only in their seeds, so a refusal (ValueError) comes
        from the first, before any is queued. The prompt is checked and keyed once for
        all of them (`prepare_prompt`)."""
        params = params or SamplingParams()
        if params.n > 1 and not isinstance(prompt, PreparedPrompt):
            prompt = self.prepare_prompt(prompt, cache_salt=options.get("cache_salt"))
        return [self.add_request(prompt, params.choice(i), **options) for i in range(params.n)]

    def step(self) -> list[StepOutput]:
        """Run one engine step; returns what each request that sampled a token got.

        With `async_scheduling`, a step of decodes alone is launched and the next one is
        planned and launched behind it before its tokens are read back (`_plan_ahead`),
        so the device runs that next step while the host records these tokens and
        returns; the next call starts from it. Each call still returns one step's tokens."""
        ahead, self._ahead = self._ahead, None
        launched: Launched | None
        if ahead is not None:
            plan, launched = ahead
        else:
            plan = self.scheduler.schedule()
            if not plan and not self.pool.num_pending_copies:  # copies started in a match
                return []  # are waited for and their pins released, even with nothing to run
            launched = self.runner.launch(plan) if self._launches(plan) else None
            if launched is None:
                return self.postprocess(plan, self.runner.execute(plan))
        nxt = self._plan_ahead(plan)
        if nxt is not None:
            nxt_launched = self.runner.launch(nxt, after=launched)
            if nxt_launched is not None:
                self._ahead = (nxt, nxt_launched)
                self.num_async_steps += 1
            else:  # its bucket's capture failed: its blocks stay its sequences', and the
                self.runner.run_copies(nxt.copies)  # offloads its growth planned run now
        # pins taken since `plan` was launched (a plan ahead's, or planned by a growth that
        # fell short, taken by the next step) are released after their copies, not now
        release = not self.pool.num_planned_pins and (
            self._ahead is None or not pins(self._ahead[0].copies)
        )
        return self.postprocess(plan, launched.result(), release_copies=release)

    def _launches(self, plan: StepPlan) -> bool:
        """Whether asynchronous scheduling launches `plan` (pipeline.goes_ahead)."""
        return (
            self.settings.async_scheduling
            and self.speculator is None
            and goes_ahead(plan, self.scheduler.running)
        )

    def _plan_ahead(self, plan: StepPlan) -> StepPlan | None:
        """The step after `plan`, launched behind it (pipeline.plan_ahead), or None."""
        if not self._launches(plan):
            return None
        return plan_ahead(plan, self.scheduler, self.kv, self.pool, self.max_model_len)

    def _start_copies(self) -> None:
        """Run the copies the pool planned so far, ahead of the step that would run them
        (the pool calls this inside a match; see BlockPool's `copies_ready`). Their pins
        are released with the step's, by `postprocess`: the step's forward waits for them."""
        self.runner.run_copies(self.pool.take_copies(), wait=False)

    def postprocess(
        self, plan: StepPlan, out: RunOutput, *, release_copies: bool = True
    ) -> list[StepOutput]:
        """After the runner executed `plan`: release the copies' pins, advance each
        sequence past the tokens it computed, register the blocks that became full
        (and keep their prompt entries), and record the sampled tokens (finishing the
        requests that are done). A request no token can follow (the runner found its
        mask keeping only banned tokens) ends after the tokens before it, finish reason
        "error", its `error` saying why; its blocks are freed as any finished request's.
        A request that ended while `plan` ran (asynchronous scheduling launched it before
        the step that ended it was recorded, or it was cancelled) is left out: its row
        computed a token past its end, into a slot of a block no request sees."""
        if release_copies:
            self.pool.complete_copies()
        if any(item.seq.status is not SeqStatus.RUNNING for item in plan.scheduled):
            plan, out = without_ended(plan, out)
        drafted: set[int] = set()  # ids of the sequences with a draft in this step
        for item in plan.scheduled:
            seq, num_prompt = item.seq, len(item.seq.prompt_token_ids)
            start = seq.num_computed_tokens
            self.prefill_tokens_computed += max(0, min(start + item.num_tokens, num_prompt) - start)
            if item.draft:  # its pending token; the kept draft tokens once recorded, below
                seq.num_computed_tokens = start + 1
                drafted.add(id(seq))
                assert self.speculator is not None
                self.speculator.num_draft_tokens += len(item.draft)
                continue
            seq.num_computed_tokens = start + item.num_tokens
        for seq, first, entries in out.prompt_entries:
            assert seq.prompt_logprobs is not None
            seq.prompt_logprobs.add(first, entries)
            self.kv.store_prompt_logprobs(seq)
        for item in plan.to_register:
            self.kv.register_full_blocks(item.seq)
        if self.kv.window is not None:  # the blocks before each next query's window
            for item in plan.scheduled:
                self.kv.release_past_window(item.seq)
        for seq, embedding in out.embeddings:
            seq.embedding = embedding
            self._keep_embedding(seq)
        outputs = []
        for seq, tokens, rows, dead_end in out.sampled:
            if rows is not None:
                self._keep_prompt_logits(seq, rows[0])
            detok = self._detokenizers.get(seq.request_id)
            num, finished = 0, False
            while num < len(tokens) and not finished:  # one token, but after a draft
                finished = record_token(
                    seq,
                    tokens[num],
                    None if rows is None else rows[num],
                    detok,
                    self.stop_token_ids,
                    self.max_model_len,
                )
                num += 1
            if dead_end and not finished:
                seq.finish_reason, seq.error, finished = "error", seq.sampling.dead_end(), True
            if drafted and id(seq) in drafted and tokens:
                # the draft tokens recorded are its tokens, and their K/V is computed
                seq.num_computed_tokens += num - 1
                assert self.speculator is not None
                self.speculator.num_accepted_tokens += len(tokens) - 1
                self.kv.register_full_blocks(seq)
            if finished:
                self._retire(seq)
            if num < len(tokens):  # an end inside a kept draft: the rest is not its
                tokens, rows = tokens[:num], None if rows is None else rows[:num]
            outputs.append(step_output(seq, tokens, rows))
        return outputs

    def cancel(self, request_id: RequestId) -> bool:
        """Stop a waiting or running request; its blocks return to the pool. False if it
        is unknown or already finished. Its completion (finish_reason "cancelled",
        the tokens so far) is then available from `take_completion`."""
        seq = self._live.get(request_id)
        if seq is None:
            return False
        seq.finish_reason = "cancelled"
        self._retire(seq)
        return True

    def capture_decode_graphs(self, max_seqs: int | None = None) -> list[int]:
        """Capture now, as vLLM does at start-up, the decode graph of every batch-size
        bucket a step could need, so no request pays a capture: buckets up to the most
        sequences that can decode at once (one block and one batched token each, and
        max_num_seqs), and at most `max_seqs`; with speculation, the drafted buckets too.
        Returns the decode bucket sizes captured ([] without graphs; those before it
        failed if a capture fails, after which decoding runs eagerly)."""
        decode = self.runner.decode
        if decode is None:
            return []
        limit = min(
            self.pool.num_blocks, self.scheduler.max_num_batched_tokens, self.settings.max_num_seqs
        )
        return decode.capture(limit if max_seqs is None else min(limit, max_seqs))

    def has_work(self) -> bool:
        """Requests to run, a step launched ahead and not yet recorded, block copies planned
        and not yet run (disk writes), or copies started and not yet known to be done
        (their pins to release)."""
        return (
            self._ahead is not None
            or self.scheduler.has_work()
            or self.pool.num_planned_copies > 0
            or self.pool.num_pending_copies > 0
        )

    def close(self, timeout_s: float = 5.0) -> None:
        """Run the block copies still planned (disk writes of the last blocks), then
        finish the disk tier's queued writes within `timeout_s` and let go of its folder.
        A step launched ahead is recorded first."""
        if self._ahead is not None:
            plan, launched = self._ahead
            self._ahead = None
            self.postprocess(plan, launched.result())
        copies = self.pool.take_copies()
        if copies:
            self.runner.run_copies(copies)
            self.pool.complete_copies()
        if self.disk_tier is not None:
            self.disk_tier.close(flush=True, timeout_s=timeout_s)

    def take_completion(self, request_id: RequestId) -> Completion:
        """The result of a finished or cancelled request, handed out once (KeyError for
        one that is unknown, still running or already taken)."""
        return completion(self._finished.pop(request_id))

    def stats(self) -> dict[str, int | float]:
        """The pool's KV cache statistics plus the engine's prefill counters, one flat dict."""
        return {
            **self.pool.stats().as_dict(),
            "prefill_tokens_computed": self.prefill_tokens_computed,
            "prefill_tokens_skipped": self.scheduler.prefill_tokens_skipped,
            "preemptions": self.scheduler.num_preemptions,
            "async_steps": self.num_async_steps,
            "prefix_waits": self.scheduler.num_prefix_waits,
            "exact_repeats": self.scheduler.num_exact_repeats,
            **(LogitsCache(0) if self.logits_cache is None else self.logits_cache).stats(),
            "spec_draft_tokens": 0 if self.speculator is None else self.speculator.num_draft_tokens,
            "spec_accepted_tokens": (
                0 if self.speculator is None else self.speculator.num_accepted_tokens
            ),
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
        }

    def take_events(self) -> list[KVEvent]:
        """KV cache events (BlockStored / BlockRemoved / AllBlocksCleared) since the last call;
        none unless the engine was built with `kv_events=True`."""
        return [] if self.events is None else self.events.take()

    def generate(
        self,
        prompt: Prompt | Seq[Prompt],
        params: SamplingParams | Seq[SamplingParams] | None = None,
        *,
        cache_salt: str | bytes | None = None,
        retention: Retention | None = None,
        priority: int = 0,
        prompt_table: np.ndarray | None = None,
        extra_ids: Seq[int] | None = None,
    ) -> Completion | list[Completion]:
        """Complete one prompt (text or token ids) or a batch of them, run together
        (`prompt_table` and `extra_ids`, as in `add_request`, apply to each). With
        `n` > 1 a prompt gets n completions, in choice order; the list holds every
        prompt's choices in turn (prompt-major, as OpenAI's `choices`), and a single
        prompt's n completions come as a list too. A batch with a prompt refused
        (ValueError) leaves none of its prompts queued."""
        prompts, param_list, is_batch = split_batch(prompt, params)
        request_ids: list[RequestId] = []
        try:
            for p, sp in zip(prompts, param_list, strict=True):
                request_ids += self.add_choices(
                    p,
                    sp,
                    cache_salt=cache_salt,
                    retention=retention,
                    priority=priority,
                    prompt_table=prompt_table,
                    extra_ids=extra_ids,
                )
        except Exception:  # a batch refused at its k-th prompt leaves nothing queued
            for request_id in request_ids:
                self.cancel(request_id)
                self.take_completion(request_id)
            raise
        while not all(r in self._finished for r in request_ids):
            self.step()
        completions = [self.take_completion(r) for r in request_ids]
        return completions if is_batch or len(completions) > 1 else completions[0]

    def embed(
        self, prompts: Seq[Prompt], *, cache_salt: str | bytes | None = None
    ) -> list[np.ndarray]:
        """Each prompt's embedding (SamplingParams.embed): the final norm's output at its
        last token, fp32 [hidden], not normalized, the prompts run together. Blocks it
        computes are cached as a generation's are; no token comes back."""
        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, embed=True)
        done = self.generate(list(prompts), [params] * len(prompts), cache_salt=cache_salt)
        assert isinstance(done, list)
        return [completion.embedding for completion in done]  # type: ignore[misc]

    def chat(
        self, messages: list[dict], params: SamplingParams | None = None
    ) -> Completion | list[Completion]:
        """Render the chat template (with the generation prompt) and complete it (n > 1:
        the list of choices, as `generate`)."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        prompt_ids = self.tokenizer.encode(text, add_special_tokens=False)
        return self.generate(prompt_ids, params)

    # -- internals --------------------------------------------------------------------------

    def _keep_prompt_logits(self, seq: Sequence, row: np.ndarray | None) -> None:
        """Store the row a request's first token came from (its prompt's last position)
        for exact repeats. An exact repeat (every prompt token cached: an ordinary
        admission matches all but the last) drew from a row the cache holds already."""
        cache = self.logits_cache
        if cache is None or seq.output_token_ids or row is None:
            return
        if seq.num_cached_tokens == len(seq.prompt_token_ids):
            return
        cache.put(self.kv.prompt_key(seq), row)

    def _keep_embedding(self, seq: Sequence) -> None:
        """Store a computed embedding beside its prompt's logits row (logits_cache.py),
        so that an exact repeat gets both without a forward step."""
        if self.logits_cache is None or seq.num_cached_tokens == len(seq.prompt_token_ids):
            return  # an exact repeat's came from the store
        key = self.kv.prompt_key(seq)
        assert seq.embedding is not None
        self.logits_cache.put(embedding_key(key), seq.embedding)

    def _retire(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self._detokenizers.pop(seq.request_id, None)
        del self._live[seq.request_id]
        self._finished[seq.request_id] = seq

    def _prompt_ids(
        self, prompt: Prompt, keep_last: int | None = None
    ) -> tuple[list[int], np.ndarray]:
        """The prompt's ids, as a list and as an int64 array (prompts.prompt_ids)."""
        return prompt_ids(
            prompt,
            self.tokenizer,
            vocab_size=self.config.vocab_size,
            max_model_len=self.max_model_len,
            keep_last=keep_last,
        )


def _namespace(cache_salt: str | bytes | None) -> Namespace:
    """A request's namespace; the unsalted one is the shared DEFAULT_NAMESPACE object, so
    the pool's per-block namespace check is an identity test, not a dataclass compare."""
    return DEFAULT_NAMESPACE if cache_salt is None else Namespace(cache_salt=cache_salt)


def _settings(settings: EngineConfig | None, overrides: dict[str, Any]) -> EngineConfig:
    """`settings` (or the defaults) with `overrides` replacing fields, validated."""
    if settings is None:
        return EngineConfig(**overrides)
    return replace(settings, **overrides) if overrides else settings
