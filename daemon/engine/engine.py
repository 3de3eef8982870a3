"""The in-process engine: `Engine.from_pretrained(...)` and `engine.generate(...)`.

`step()` is three calls: `plan = scheduler.schedule()` picks the tokens and the
blocks (the pool's lookups and allocations, and the block copies they need),
`out = runner.execute(plan)` runs the copies and then the forward and samples,
and `postprocess(plan, out)` registers the blocks that became full, records the
new tokens, detokenizes them and finishes the requests that are done.
"""

from __future__ import annotations

import importlib.metadata
import itertools
import secrets
import weakref
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from ...blockpool.disk import DiskTier
from ...blockpool.disk_config import DiskTierConfig
from ...blockpool.events import EventQueue, KVEvent
from ...blockpool.hashing import BlockHash, Namespace, encode_ids
from ...blockpool.host import HostTier
from ...blockpool.pool import BlockPool
from ...cuda.backend import get_backend
from ...cuda.kvcache import kv_cache_shape
from ..model.config import ModelConfig
from ..model.fingerprint import model_fingerprint
from ..model.llama import LlamaModel
from ..model.tokenizer import IncrementalDetokenizer, Tokenizer
from ..model.weights import load_weights
from .config import EngineConfig, SettingError
from .kvmanager import KVCacheManager
from .logits_cache import LogitsCache
from .params import Completion, Retention, SamplingParams, StepOutput, TokenLogprobs
from .prompt_logprobs import PromptLogprobs, PromptLogprobStore
from .prompt_table import check_prompt_table
from .prompts import PreparedPrompt, Prompt, prompt_ids
from .runner import ModelRunner, RunOutput
from .scheduler import Scheduler, StepPlan
from .sequence import RequestId, Sequence


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
        self.max_model_len = settings.max_model_len or config.max_position_embeddings
        if self.max_model_len > config.max_position_embeddings:
            raise SettingError(
                "max_model_len",
                f"max_model_len must be in [2, {config.max_position_embeddings}] for this model; "
                f"got {settings.max_model_len}",
            )
        if settings.max_prompt_logprobs > config.vocab_size:
            raise SettingError(
                "max_prompt_logprobs",
                f"max_prompt_logprobs must be at most the vocabulary size {config.vocab_size} "
                f"for this model; got {settings.max_prompt_logprobs}",
            )
        block_bytes = config.kv_bytes_per_token() * settings.block_size
        num_device_blocks = settings.device_blocks(
            block_bytes, model.ops.device_memory_bytes(), model.num_bytes()
        )
        num_host_blocks = settings.host_blocks(block_bytes)
        on_gpu = model.ops.name == "cupy"
        cuda_graphs = on_gpu if settings.cuda_graphs is None else settings.cuda_graphs
        self.disk_tier = _open_disk_tier(settings, config, model, model_fingerprint)
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
        )
        self.events = EventQueue()
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
            # a long run of disk hits: their device copies start while later reads go on
            copies_ready=self._start_copies,
        )
        # prompt entries of as many blocks as the device pool and host tier hold together
        self.logprob_store = PromptLogprobStore(
            num_device_blocks + num_host_blocks,
            settings.max_prompt_logprobs,
            block_size=settings.block_size,
            disk=self.disk_tier,  # entries kept as sidecars of the blocks' files
        )
        self.kv = KVCacheManager(self.pool, model_fingerprint, self.logprob_store)
        self.logits_cache = (
            LogitsCache(settings.logits_cache_bytes) if settings.logits_cache_bytes else None
        )
        self.scheduler = Scheduler(self.kv, settings.step_budget(on_gpu), self.logits_cache)
        self.stop_token_ids = frozenset(tokenizer.eos_token_ids) | frozenset(config.eos_token_ids)
        self.prefill_tokens_computed = 0
        self._next_id = itertools.count()
        self._detokenizers: dict[RequestId, IncrementalDetokenizer] = {}
        self._live: dict[RequestId, Sequence] = {}
        self._finished: dict[RequestId, Sequence] = {}

    @classmethod
    def from_pretrained(
        cls,
        path: Path | str | None = None,
        settings: EngineConfig | None = None,
        *,
        progress: Callable[[int, int], None] | None = None,
        **overrides: Any,
    ) -> Engine:
        """Load a Hugging Face Llama folder (`path`, else `settings.model`); none means
        the default model, prepared (fetched and converted) first if it is missing.

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
            folder = Path(settings.model)
        ops = get_backend(settings.backend)
        config = ModelConfig.from_dir(folder)
        tokenizer = Tokenizer.from_dir(folder)
        model = LlamaModel(config, load_weights(folder, config, progress), ops)
        return cls(config, tokenizer, model, settings, model_fingerprint=model_fingerprint(folder))

    # -- requests ---------------------------------------------------------------------------

    def prepare_prompt(
        self, prompt: Prompt, *, cache_salt: str | bytes | None = None
    ) -> PreparedPrompt:
        """`prompt` checked as `add_request` checks it (ValueError), with its ids encoded
        as block keys and, when it has no prompt-table ids, its full blocks' keys under
        `cache_salt`: the admission work that depends on the prompt alone. Safe on any
        thread (it reads the engine's fixed settings only), so a server runs it off its
        loop; `add_request` takes the result in place of the prompt (prompts.py)."""
        ids, array = self._prompt_ids(prompt)
        array.flags.writeable = False
        id_bytes = encode_ids(array)  # as block keys encode them
        namespace = Namespace(cache_salt=cache_salt)
        keys: tuple[BlockHash, ...] = ()
        if self.pool.enable_reuse and int(array.max()) < self.config.vocab_size:
            keys = tuple(self.kv.prompt_keys(id_bytes, namespace))
        return PreparedPrompt(tuple(ids), array, id_bytes, namespace, keys, owner=self)

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
        if params.n != 1:
            raise ValueError(
                f"add_request runs one completion; n={params.n} goes through add_choices "
                "(or generate), which adds one request per choice"
            )
        if isinstance(priority, bool) or not isinstance(priority, int | np.integer):
            raise ValueError(f"priority must be an integer (lower runs first); got {priority!r}")
        prepared = prompt.checked_by(self) if isinstance(prompt, PreparedPrompt) else None
        if prepared is None:
            prompt_ids, prompt_array = self._prompt_ids(prompt)
            id_bytes = encode_ids(prompt_array)  # as block keys encode them
        else:
            prompt_ids, prompt_array = list(prepared.ids), prepared.array
            id_bytes = prepared.id_bytes
        self._check_prompt_logprobs(params, prompt_table, extra_ids)
        table = check_prompt_table(
            prompt_array,
            prompt_table,
            extra_ids,
            vocab_size=self.config.vocab_size,
            hidden_size=self.config.hidden_size,
        )
        num_blocks_needed = -(
            -min(len(prompt_ids) + params.max_tokens, self.max_model_len) // self.pool.block_size
        )
        if num_blocks_needed > self.pool.num_blocks:
            raise ValueError(
                f"request needs {num_blocks_needed} KV blocks (prompt {len(prompt_ids)} + max_tokens "
                f"{params.max_tokens} tokens) but the pool has {self.pool.num_blocks}"
            )
        request_id = RequestId(next(self._next_id))
        seed = params.seed if params.seed is not None else secrets.randbits(64)
        namespace = Namespace(cache_salt=cache_salt)
        seq = Sequence(
            request_id,
            prompt_ids,
            params,
            seed,
            namespace=namespace,
            retention=retention,
            priority=int(priority),
            prompt_table=None if table is None else table.table,
            prompt_extra_ids=None if table is None else table.extra_ids,
            prompt_id_bytes=id_bytes,
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
        if params.detokenize:
            text_ids = prompt_ids if table is None else seq.text_prompt_ids()
            self._detokenizers[request_id] = IncrementalDetokenizer(
                self.tokenizer, text_ids, skip_special_tokens=params.skip_special_tokens
            )
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
        """Run one engine step; returns what each request that sampled a token got."""
        plan = self.scheduler.schedule()
        if not plan and not self.pool.num_pending_copies:  # copies started in a match
            return []  # are waited for and their pins released, even with nothing to run
        out = self.runner.execute(plan)
        return self.postprocess(plan, out)

    def _start_copies(self) -> None:
        """Run the copies the pool planned so far, ahead of the step that would run them
        (the pool calls this inside a match; see BlockPool's `copies_ready`). Their pins
        are released with the step's, by `postprocess`: the step's forward waits for them."""
        self.runner.run_copies(self.pool.take_copies())

    def postprocess(self, plan: StepPlan, out: RunOutput) -> list[StepOutput]:
        """After the runner executed `plan`: release the copies' pins, advance each
        sequence past the tokens it computed, register the blocks that became full
        (and keep their prompt entries), and record the sampled tokens (finishing the
        requests that are done)."""
        self.pool.complete_copies()
        for item in plan.scheduled:
            seq, num_prompt = item.seq, len(item.seq.prompt_token_ids)
            start = seq.num_computed_tokens
            self.prefill_tokens_computed += max(0, min(start + item.num_tokens, num_prompt) - start)
            seq.num_computed_tokens = start + item.num_tokens
        for seq, first, entries in out.prompt_entries:
            assert seq.prompt_logprobs is not None
            seq.prompt_logprobs.add(first, entries)
            self.kv.store_prompt_logprobs(seq)
        for item in plan.to_register:
            self.kv.register_full_blocks(item.seq)
        outputs = []
        for seq, token, logits in out.sampled:
            self._keep_prompt_logits(seq, logits)
            if self._append_token(seq, token, logits):
                self._retire(seq)
            outputs.append(self._step_output(seq, token, logits))
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
        sequences that can decode at once (one block and one batched token each), and
        at most `max_seqs`. Returns the bucket sizes captured ([] without graphs; those
        before it failed if a capture fails, after which decoding runs eagerly)."""
        decode = self.runner.decode
        if decode is None:
            return []
        limit = min(self.pool.num_blocks, self.scheduler.max_num_batched_tokens)
        return decode.capture(limit if max_seqs is None else min(limit, max_seqs))

    def has_work(self) -> bool:
        """Requests to run, block copies planned and not yet run (disk writes), or copies
        started and not yet known to be done (their pins to release)."""
        return (
            self.scheduler.has_work()
            or self.pool.num_planned_copies > 0
            or self.pool.num_pending_copies > 0
        )

    def close(self, timeout_s: float = 5.0) -> None:
        """Run the block copies still planned (disk writes of the last blocks), then
        finish the disk tier's queued writes within `timeout_s` and let go of its folder."""
        copies = self.pool.take_copies()
        if copies:
            self.runner.run_copies(copies)
            self.pool.complete_copies()
        if self.disk_tier is not None:
            self.disk_tier.close(flush=True, timeout_s=timeout_s)

    def take_completion(self, request_id: RequestId) -> Completion:
        seq = self._finished.pop(request_id)
        assert seq.finish_reason is not None
        return Completion(
            prompt_token_ids=seq.prompt_token_ids,
            token_ids=seq.output_token_ids,
            text=seq.text,
            finish_reason=seq.finish_reason,
            cached_tokens=seq.num_cached_tokens or 0,
            host_cached_tokens=seq.num_cached_host_tokens,
            disk_cached_tokens=seq.num_cached_disk_tokens,
            logits=np.stack(seq.logits) if seq.params.return_logits else None,
            logprobs=seq.logprobs if seq.params.logprobs is not None else None,
            prompt_logprobs=_prompt_entries(seq),
        )

    def stats(self) -> dict[str, int | float]:
        """The pool's KV cache statistics plus the engine's prefill counters, one flat dict."""
        return {
            **self.pool.stats().as_dict(),
            "prefill_tokens_computed": self.prefill_tokens_computed,
            "prefill_tokens_skipped": self.scheduler.prefill_tokens_skipped,
            "preemptions": self.scheduler.num_preemptions,
            "prefix_waits": self.scheduler.num_prefix_waits,
            "exact_repeats": self.scheduler.num_exact_repeats,
            **(LogitsCache(0) if self.logits_cache is None else self.logits_cache).stats(),
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
        }

    def take_events(self) -> list[KVEvent]:
        """KV cache events (BlockStored / BlockRemoved / AllBlocksCleared) since the last call."""
        return self.events.take()

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
        # a batch's items are prompts, a prompt's are ids: the first item says which (a
        # scan of every item, as the prompt's own check makes, would cost a 4k-token
        # prompt a second pass); a list mixing the two is refused either way
        is_batch = (
            isinstance(prompt, list | tuple)
            and bool(prompt)
            and isinstance(prompt[0], str | list | tuple | PreparedPrompt)
        )
        prompts: list[Prompt] = list(prompt) if is_batch else [prompt]  # type: ignore[arg-type]
        if params is None or isinstance(params, SamplingParams):
            param_list = [params or SamplingParams()] * len(prompts)
        else:
            param_list = list(params)
            if len(param_list) != len(prompts):
                raise ValueError(f"got {len(param_list)} SamplingParams for {len(prompts)} prompts")
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

    def _retire(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self._detokenizers.pop(seq.request_id, None)
        del self._live[seq.request_id]
        self._finished[seq.request_id] = seq

    def _step_output(self, seq: Sequence, token: int, logits: np.ndarray | None) -> StepOutput:
        # While running, hold back the text that could still be the start of a stop string.
        hold = 0 if seq.finish_reason else max(map(len, seq.params.stop), default=1) - 1
        end = max(len(seq.text) - hold, seq.num_text_emitted)
        delta = seq.text[seq.num_text_emitted : end]
        seq.num_text_emitted = end
        return StepOutput(
            seq.request_id,
            [token],
            delta,
            seq.finish_reason,
            logits[None].copy() if seq.params.return_logits else None,
            seq.logprobs[-1:] if seq.params.logprobs is not None else None,
        )

    def _check_prompt_logprobs(
        self, params: SamplingParams, prompt_table: object, extra_ids: object
    ) -> None:
        num_top, limit = params.prompt_logprobs, self.settings.max_prompt_logprobs
        if num_top is None:
            return
        if num_top > limit:
            raise ValueError(
                f"prompt_logprobs must be an integer in [0, {limit}] (the engine's "
                f"max_prompt_logprobs) or None (off); got {num_top!r}"
            )
        if prompt_table is not None or extra_ids is not None:
            raise ValueError(
                "prompt_logprobs is not available with prompt_table or extra_ids: a "
                "prompt-table id is no vocabulary token to take a logprob of"
            )

    def _prompt_ids(self, prompt: Prompt) -> tuple[list[int], np.ndarray]:
        """The prompt's ids, as a list and as an int64 array (prompts.prompt_ids)."""
        return prompt_ids(
            prompt,
            self.tokenizer,
            vocab_size=self.config.vocab_size,
            max_model_len=self.max_model_len,
        )

    def _append_token(self, seq: Sequence, token: int, logits: np.ndarray | None) -> bool:
        """Record a sampled token; returns True when the request is finished."""
        params = seq.params
        seq.output_token_ids.append(token)
        if (logprobs := seq.sampling.record(token, logits)) is not None:
            seq.logprobs.append(logprobs)
        if params.return_logits:  # the runner brings the row back: it is returned
            seq.logits.append(np.array(logits, dtype=np.float32))
        # Without detokenize (no stop strings; the daemon detokenizes on its own thread)
        # only token ids decide the end: eos, stop_token_ids, length.
        detok = self._detokenizers.get(seq.request_id)
        searched = max(len(seq.text) - max(map(len, params.stop), default=0), 0)
        if detok is not None:
            seq.text += detok.push(token)
        if (
            token in self.stop_token_ids and not params.ignore_eos
        ) or token in params.stop_token_ids:
            seq.finish_reason = "stop"
        elif params.stop and (cut := _find_stop(seq.text, params.stop, searched)) is not None:
            seq.text = seq.text[:cut]
            seq.finish_reason = "stop"
            return True
        elif len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
        if seq.finish_reason is None:
            return False
        if detok is not None:
            seq.text += detok.flush()
        return True


def _open_disk_tier(
    settings: EngineConfig, config: ModelConfig, model: LlamaModel, fingerprint: bytes
) -> DiskTier | None:
    """The disk tier `settings.disk_cache` names, its index rebuilt from its files; a
    folder that turns out unusable (locked by another daemon, a read-only mount) gives
    a disabled tier and one warning."""
    if settings.disk_cache is None:
        return None
    if not fingerprint:
        raise ValueError("a disk cache needs the model fingerprint (model_fingerprint=...)")
    ops = model.ops
    device = "cpu"
    if ops.name == "cupy":
        from ...cuda.gemm_sm90_kernel import device_arch

        device = f"sm_{device_arch()}/{ops.kernel_choice}"
    try:
        version = importlib.metadata.version("reprise")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    shape = kv_cache_shape(
        1, config.num_layers, config.num_kv_heads, settings.block_size, config.head_dim
    )
    try:
        disk_config = DiskTierConfig(
            directory=settings.disk_cache,
            max_bytes=settings.disk_cache_bytes,
            block_shape=shape[1:],
            block_size=settings.block_size,
            model_fingerprint=fingerprint,
            # KV bytes are bit-identical per backend and device (DESIGN §4), and code
            # changes may change them: files of another producer never match.
            producer=f"{ops.name}/{device}/reprise {version}",
        )
    except ValueError as e:
        raise SettingError("disk_cache_gb", f"disk_cache_gb: {e}") from e
    return DiskTier.open(disk_config)


def _prompt_entries(seq: Sequence) -> list[TokenLogprobs | None] | None:
    """A finished request's prompt entries; None unless it asked and got them all (a
    request cancelled during its prefill has not)."""
    wanted = seq.prompt_logprobs
    return wanted.entries() if wanted is not None and wanted.complete else None


def _find_stop(text: str, stops: list[str], start: int) -> int | None:
    """Index where the earliest stop string begins at or after `start`, if any."""
    hits = [i for s in stops if (i := text.find(s, start)) != -1]
    return min(hits) if hits else None


def _settings(settings: EngineConfig | None, overrides: dict[str, Any]) -> EngineConfig:
    """`settings` (or the defaults) with `overrides` replacing fields, validated."""
    if settings is None:
        return EngineConfig(**overrides)
    return replace(settings, **overrides) if overrides else settings
