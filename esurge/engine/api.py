"""eSurge: the engine as a Python library (generate, stream, abort)."""

from __future__ import annotations

import functools
import itertools
import logging
import queue
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from pathlib import Path
from types import TracebackType
from typing import Any

import jax
from tokenizers import Tokenizer

from esurge.config import Config, ParallelConfig
from esurge.engine.chat import ChatMessage, ChatPrompt, ChatTemplate
from esurge.engine.compile_cache import enable_compile_cache
from esurge.engine.core import EngineCore
from esurge.engine.inputs import InputProcessor, Prompt
from esurge.engine.loop import EngineDeadError, EngineLoop, Submission
from esurge.engine.multihost.cluster import join_cluster
from esurge.engine.multihost.lockstep import (
    LockstepExecutor,
    check_multihost_config,
    connect_followers,
)
from esurge.engine.output_processor import OutputProcessor
from esurge.engine.request_output import RequestDelta, RequestOutput
from esurge.engine.stats import EngineStats, StatsRecorder
from esurge.errors import InvalidConfigError, InvalidRequestError, RequestField
from esurge.models.checkpoint import hf_tokenizer_of
from esurge.models.loader import LoadedModel, load_model
from esurge.packaged import resolve_model_path
from esurge.runner.runner import eSurgeRunner
from esurge.sampling_params import SamplingParams
from esurge.scheduler.scheduler import Scheduler
from esurge.settings import EngineSettings, derived_config
from esurge.structured_output.engine import StructuredOutputs

__all__ = ["default_config", "eSurge"]

log = logging.getLogger(__name__)


def default_config(model: LoadedModel, max_num_seqs: int | None = None) -> Config:
    """The checkpoint's derived config (`esurge.settings.derived_config`): its
    context length, chunked prefill, async scheduling, prefix caching, and the
    backend's budget, 16 requests and 256-token steps on CPU, 32 and 2048
    elsewhere; max_num_seqs overrides the count."""
    max_len = int(getattr(model.hf_config, "max_position_embeddings", 0) or 2048)
    return derived_config(max_len, jax.default_backend(), max_num_seqs)


def _load_tokenizer(model: LoadedModel, tokenizer_dir: Path | None
                    ) -> tuple[Tokenizer | None, ChatTemplate | None]:
    """The engine's tokenizer and chat template.

    An HF directory (the checkpoint's, or `tokenizer_dir`) encodes with its
    tokenizer.json as it is, and takes its chat template, if any, from the
    transformers tokenizer of the same files; a GGUF's tokenizer is the one
    transformers rebuilds from the file's metadata.
    """
    hf_tokenizer = model.hf_tokenizer if tokenizer_dir is None else hf_tokenizer_of(tokenizer_dir)
    if tokenizer_dir is None and model.source_kind == "gguf":
        backend = None if hf_tokenizer is None else hf_tokenizer.backend_tokenizer
    else:
        file = (tokenizer_dir or model.model_dir) / "tokenizer.json"
        backend = Tokenizer.from_file(str(file)) if file.is_file() else None
    if backend is None:
        return None, None
    return backend, ChatTemplate.of(hf_tokenizer, model.eos_token_ids)


def _prompt_list(prompts: Sequence[Prompt] | Prompt) -> list[Prompt]:
    """A single prompt (text, token ids, chat) or a list of them, as a list."""
    if isinstance(prompts, str | ChatPrompt):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [[int(t) for t in items]]  # type: ignore[arg-type]
    return items  # type: ignore[return-value]


def _print_progress(done: int, total: int, what: str) -> None:
    width = 30
    filled = width * done // total
    sys.stderr.write(f"\r[warm-up] [{'#' * filled}{'.' * (width - filled)}] {done}/{total} "
                     f"{what[:48]:<48}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()


class eSurge:
    """A loaded model served by a continuous-batching engine on a background thread.

    model_dir is an HF checkpoint directory (config.json, *.safetensors and,
    optionally, tokenizer.json) or a single .gguf file; without a tokenizer,
    prompts must be token ids. config None derives one from the checkpoint
    (see default_config). The settings beside it (dtype, memory_fraction,
    min_token_bucket, decode_steps, kv_cache_dtype, speculation, parallel_config:
    `esurge.settings.EngineSettings`) come from
    `settings`, each keyword argument given overriding it. dtype "auto" picks
    the checkpoint's precision where this backend runs it fast (on CPU:
    bfloat16 checkpoints in bfloat16 where the CPU has native bfloat16 dot
    products, float32 otherwise; esurge.models.loader.resolve_dtype). Compiled programs are kept on
    disk (esurge.engine.compile_cache), so the next start's warm-up mostly
    reads them back.
    decode_steps > 1 lets a step run that many decode iterations when every
    running request decodes with no per-token sampling state (no penalties,
    masks or logprobs) and no waiting request could start
    (esurge/scheduler/decode_burst.py): the same tokens, less host work per
    token, deltas of up to decode_steps tokens.
    """

    def __init__(self, model_dir: str | Path, config: Config | None = None,
                 dtype: str | None = None, *, settings: EngineSettings | None = None,
                 tokenizer_dir: str | Path | None = None, memory_fraction: float | None = None,
                 warmup: bool = True, show_progress: bool = True,
                 min_token_bucket: int | None = None, decode_steps: int | None = None,
                 parallel_config: ParallelConfig | None = None,
                 kv_cache_dtype: str | None = None, speculation: str | None = None) -> None:
        enable_compile_cache()
        # One override path: the keyword arguments given (not None) over `settings`.
        self.settings = (settings or EngineSettings()).with_overrides(
            dtype=dtype, memory_fraction=memory_fraction, min_token_bucket=min_token_bucket,
            decode_steps=decode_steps, parallel_config=parallel_config,
            kv_cache_dtype=kv_cache_dtype, speculation=speculation)
        parallel = self.settings.parallel_config
        if not parallel.is_leader:
            raise InvalidConfigError("host_rank", f"eSurge runs on the leader (host_rank 0); "
                                     f"host {parallel.host_rank} runs "
                                     "esurge.engine.follower.run_follower")
        join_cluster(parallel)
        model_path = resolve_model_path(model_dir)
        self.model = load_model(model_path, self.settings.dtype,
                                tensor_parallel_size=parallel.tensor_parallel_size)
        self.config = config if config is not None else default_config(self.model)
        self._check_config(self.config)
        link = None
        if parallel.is_multihost:
            check_multihost_config(self.config, self.settings)
            link = connect_followers(model_path, self.config, self.settings)
        self.tokenizer, self.chat_template = _load_tokenizer(
            self.model, Path(tokenizer_dir) if tokenizer_dir else None)
        self.grammars = StructuredOutputs(self.tokenizer, self.model.vocab_size,
                                          self.model.eos_token_ids)
        self.runner = eSurgeRunner(self.model, self.config, self.settings)
        mesh = self.runner.mesh
        # The device mesh the model is split over, axis name -> size ({} on one device).
        self.mesh_axes: dict[str, int] = (
            {} if mesh is None else {str(name): int(n) for name, n in mesh.shape.items()})
        self.scheduler = Scheduler.from_runner(
            self.runner, enable_prefix_caching=self.config.cache_config.enable_prefix_caching)
        if self.settings.decode_steps > 1:
            log.info("decode bursts: up to %d decode iterations per step while every running "
                     "request decodes without per-token sampling state and no waiting "
                     "request could start", self.settings.decode_steps)
        self.warmup_seconds = (self.runner.warmup(_print_progress if show_progress else None)
                               if warmup else 0.0)
        sched = self.config.scheduler_config
        self.inputs = InputProcessor(self.tokenizer, self.model.vocab_size,
                                     self.model.eos_token_ids, sched.max_model_len,
                                     self.chat_template)
        executor = self.runner if link is None else LockstepExecutor(self.runner, link)
        core = EngineCore(self.scheduler, executor,
                          async_scheduling=self.runner.config.scheduler_config.async_scheduling)
        recorder = StatsRecorder(self.scheduler, lambda: self.runner.spec_stats)
        self._loop = EngineLoop(core, OutputProcessor(self.tokenizer), recorder,
                                self.scheduler.kv_cache_manager.pool.events)
        if link is not None:  # a follower that leaves or diverges ends the engine
            link.on_failure = self._loop.fail
        self._loop.start()
        self._ids = itertools.count()
        self._id_lock = threading.Lock()

    def _check_config(self, config: Config) -> None:
        limit = getattr(self.model.hf_config, "max_position_embeddings", None)
        max_len = config.scheduler_config.max_model_len
        if limit is not None and max_len > int(limit):
            raise InvalidConfigError("max_model_len", f"max_model_len ({max_len}) exceeds the "
                                     f"model's max_position_embeddings ({limit})")
        spec = config.speculative_config
        if (spec is not None and spec.use_eagle() and spec.speculative_model is not None
                and not Path(spec.speculative_model).is_dir()):
            raise InvalidConfigError("speculative_model", f"speculative_model "
                                     f"{spec.speculative_model!r} is not a directory")

    @property
    def loop(self) -> EngineLoop:
        """The engine loop (for servers that drive requests themselves)."""
        return self._loop

    @property
    def stats(self) -> EngineStats:
        """The engine's numbers as the loop thread last published them (any thread)."""
        return self._loop.stats

    def next_request_id(self) -> str:
        """A fresh request id."""
        with self._id_lock:
            return f"req-{next(self._ids)}"

    def submit(self, prompt: Prompt, sampling_params: SamplingParams | None,
               callback: Any, *, request_id: str | None = None, priority: int = 0,
               cache_salt: str | None = None, final_only: bool = False) -> str:
        """Validate and queue one request; outputs go to callback on the engine thread:
        a RequestDelta per step, or with final_only the finished RequestOutput only.

        Blocks until the engine thread accepted it (at most one step)."""
        rid, accepted = self.submit_nowait(prompt, sampling_params, callback,
                                           request_id=request_id, priority=priority,
                                           cache_salt=cache_salt, final_only=final_only)
        accepted.result()
        return rid

    def submit_nowait(self, prompt: Prompt, sampling_params: SamplingParams | None,
                      callback: Any, *, request_id: str | None = None, priority: int = 0,
                      cache_salt: str | None = None, final_only: bool = False
                      ) -> tuple[str, Future[None]]:
        """Like submit, without waiting: the future fails if the engine refuses it.

        Input errors that need no engine state still raise ValueError at once.
        final_only: the callback gets the finished RequestOutput (or the
        engine's error) only, not a RequestDelta per step."""
        rid, stage = self._staged(prompt, sampling_params, callback, request_id=request_id,
                                  priority=priority, cache_salt=cache_salt,
                                  final_only=final_only)
        submission = stage()
        self._loop.submit_all([submission])
        return rid, submission.accepted

    def _staged(self, prompt: Prompt, sampling_params: SamplingParams | None,
                callback: Any, *, request_id: str | None, priority: int,
                cache_salt: str | None, final_only: bool
                ) -> tuple[str, Callable[[], Submission]]:
        """A request validated and tokenized, and what stages it for the loop
        (EngineLoop.submit_all queues it)."""
        rid = request_id or self.next_request_id()
        prepared = self.inputs.prepare(rid, prompt, sampling_params, priority, cache_salt)
        if (prepared.params.structured_outputs is not None
                and self.settings.parallel_config.is_multihost):
            # Followers would need the compiled grammar (its matchers do not cross
            # the step channel) to build the same token masks.
            raise InvalidRequestError(RequestField.sampling("structured_outputs"),
                                      "structured outputs are not supported on a multi-host "
                                      "engine yet")
        eos = self.inputs.eos_token_id
        grammar = self.grammars.compile(prepared.params.structured_outputs)
        return rid, functools.partial(
            self._loop.stage, rid, prepared.prompt, prepared.prompt_token_ids,
            prepared.params, lambda ids: prepared.engine_requests(ids, eos), callback,
            final_only, grammar, self.grammars.timeout)

    def generate(self, prompts: Sequence[Prompt] | Prompt,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, priorities: Sequence[int] | None = None) -> list[RequestOutput]:
        """Run prompts to completion; outputs in prompt order."""
        plist = _prompt_list(prompts)
        params = (list(sampling_params) if isinstance(sampling_params, Sequence)
                  else [sampling_params] * len(plist))
        if len(params) != len(plist):
            raise ValueError(f"got {len(params)} sampling_params for {len(plist)} prompts")
        results: queue.SimpleQueue[RequestOutput | EngineDeadError] = queue.SimpleQueue()

        def on_output(item: RequestOutput | RequestDelta | EngineDeadError) -> None:
            if isinstance(item, EngineDeadError | RequestOutput):  # final_only: the result
                results.put(item)

        ids: list[str] = []
        try:
            # Tokenize everything, then queue everything as one command, so the
            # engine admits the whole batch in its next step: queued as each was
            # tokenized, the first request of a batch of chats started alone.
            staged = []
            for i, (prompt, p) in enumerate(zip(plist, params, strict=True)):
                prio = priorities[i] if priorities is not None else 0
                rid, stage = self._staged(prompt, p, on_output, request_id=None,
                                          priority=prio, cache_salt=None, final_only=True)
                ids.append(rid)
                staged.append(stage())
            self._loop.submit_all(staged)
            for submission in staged:
                submission.accepted.result()
        except BaseException:
            for rid in ids:
                self.abort(rid)
            raise
        done: dict[str, RequestOutput] = {}
        while len(done) < len(ids):
            item = results.get()
            if isinstance(item, EngineDeadError):
                raise item
            done[item.request_id] = item
        return [done[rid] for rid in ids]

    def chat(self, messages: Sequence[ChatMessage | dict[str, Any]] | ChatPrompt,
             sampling_params: SamplingParams | None = None) -> RequestOutput:
        """Answer a conversation, rendered with the model's chat template.

        messages: dicts with "role" and "content" (or ChatMessages), or a
        ChatPrompt for add_generation_prompt / template variables. The reply
        ends at the template's end-of-turn token."""
        [output] = self.generate([ChatPrompt.of(messages)], sampling_params)
        return output

    def stream(self, prompt: Prompt, sampling_params: SamplingParams | None = None, *,
               request_id: str | None = None, priority: int = 0) -> Iterator[RequestDelta]:
        """Yield a RequestDelta per engine step with something new (tokens, text, events)."""
        items: queue.SimpleQueue[RequestDelta | RequestOutput | EngineDeadError] = (
            queue.SimpleQueue())
        rid = self.submit(prompt, sampling_params, items.put, request_id=request_id,
                          priority=priority)
        finished = False
        try:
            while not finished:
                item = items.get()
                if isinstance(item, EngineDeadError):
                    raise item
                if not isinstance(item, RequestDelta):
                    raise TypeError(f"a streaming callback got {type(item).__name__}")
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(rid)

    def abort(self, request_id: str) -> None:
        """Stop a request; its pages are freed (no-op if it already ended)."""
        self._loop.abort(request_id)

    def shutdown(self) -> None:
        """Stop the engine thread."""
        self._loop.shutdown()
        self.grammars.shutdown()

    def __enter__(self) -> eSurge:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.shutdown()
