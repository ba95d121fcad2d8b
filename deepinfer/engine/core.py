"""One engine over a `ModelHost`: intake, the cache, the scheduler, the runner, and the step.

A step is `Scheduler.schedule()`, `ModelRunner.execute()`, then `Scheduler.update()` (the scheduler
owns every change to a queued sequence). With async scheduling the update of a step comes after the
next step is queued, so the host schedules and prepares step t + 1 while the device runs step t; a
speculative step with a structured constraint (`SchedulerOutput.synchronous`) is read back at once,
since the constraint cuts the next step's drafts from the tokens it keeps.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch.distributed as dist

from deepinfer.engine.cache import CacheManager, step_budget
from deepinfer.engine.config import EngineConfig
from deepinfer.engine.drafter import DEVICE_SPECULATION, build_drafter
from deepinfer.engine.host import ModelHost
from deepinfer.engine.output import OutputProcessor
from deepinfer.engine.prefix import PrefixCache
from deepinfer.engine.runner import ModelRunner, RunnerOutput
from deepinfer.engine.scheduler import Scheduler, SchedulerOutput
from deepinfer.engine.sequence import Sequence
from deepinfer.engine.structured import StructuredCompiler
from deepinfer.errors import DeepInferError
from deepinfer.model import bucket
from deepinfer.outputs import RequestOutput
from deepinfer.parallel import agree
from deepinfer.parallel.experts import exchange_capacity
from deepinfer.sampling_params import CONTENT_SEEDS, TOOL_CALL, SamplingParams, derive_seed, request_content_hash


class RequestError(DeepInferError, ValueError):
    """A prompt the engine cannot serve."""


class PromptTooLongError(RequestError):
    """A prompt longer than the engine's limits allow."""

    kind = "prompt_too_long"


class EngineCore:
    """An engine over `host`'s model, run as `config` says; it resolves the config (`max_model_len`
    and `weight_storage` filled in, `async_scheduling` off where the Engram tables are in host memory
    or the expert exchange has a fixed capacity, CUDA graphs off where ranks step in lockstep) and
    keeps it as `engine_config`."""

    def __init__(self, host: ModelHost, config: EngineConfig) -> None:
        self.host = host
        self.requested = config
        self.seed, self.unseeded_seeds = config.seed, config.unseeded_seeds
        config = replace(config, weight_storage=host.weight_storage)
        if host.model.engram_tokens is not None and host.model.engram_on_host:
            # the step's Engram rows are gathered on the host from its tokens: no step can be queued
            # before the tokens of the one before are read
            config = replace(config, async_scheduling=False)
        if config.expert_capacity is not None:
            # a step that overflows the exchange runs again before its results apply: none may be queued behind it
            config = replace(config, async_scheduling=False)
        if host.layout.lockstep:  # MoE exchanges read their sizes on the host, splits upload rows: no graphs
            config = replace(config, cuda_graphs=False)
        host.check_max_model_len(config)
        draft = None
        if config.speculation in DEVICE_SPECULATION:
            draft = host.draft_model(config.speculation, config.cache_qdq)
            if draft.max_drafts is not None and config.draft_tokens > draft.max_drafts:
                raise DeepInferError(f"draft_tokens={config.draft_tokens}: the checkpoint's {config.speculation} "
                                     f"draft model proposes at most {draft.max_drafts} tokens per step")
        self.pools = host.family.draft_pools(host.model.pools, draft) if draft is not None else host.model.pools
        if config.max_model_len is None:  # ranks sharing requests must make the same steps: the same cache
            config = replace(config, max_model_len=agree(host.default_max_model_len(config, self.pools)))
        self.engine_config = config
        self.max_model_len = config.max_model_len
        self.max_num_batched_tokens = step_budget(config.max_num_batched_tokens, self.max_model_len,
                                                  config.enable_chunked_prefill)
        self.cache = CacheManager(
            self.pools, max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len, max_step_tokens=self.max_num_batched_tokens,
            num_blocks=config.num_cache_blocks, block_size=config.block_size, dtype=host.dtype, device=host.device,
        )
        self.output = OutputProcessor(host.tokenizer, host.config.eos_token_ids, self.max_model_len, config.numerics)
        self.scheduler = Scheduler(
            self.cache, self.output, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens, chunked_prefill=config.enable_chunked_prefill,
            drafter=build_drafter(config.speculation), draft_tokens=config.draft_tokens,
            prefix=PrefixCache(self.cache) if config.prefix_caching else None,
            plan_verification=config.verify_policy == "throughput",
        )
        drafts = None
        if draft is not None:
            drafts = host.family.draft_runner(draft, self.cache, config.draft_tokens, config.draft_confidence)
        self.runner = ModelRunner(host.model, self.cache, host.device, cuda_graphs=config.cuda_graphs, drafts=drafts,
                                  draft_tokens=config.draft_tokens, timed=self.scheduler.step_cost is not None)
        self.async_scheduling = config.async_scheduling
        self.in_flight: tuple[SchedulerOutput, RunnerOutput] | None = None
        self.next_id = 0
        self.num_exchange_redos = 0  # steps run again after a fixed-capacity exchange overflowed (on any rank)
        self.num_exchange_overflow_slots = 0  # the slots those steps left out, over every rank

    # requests in -------------------------------------------------------------------------------

    def tokenize(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids of `text`. A text too long for max_model_len even if every token were the
        tokenizer's longest is refused before tokenizing (a huge prompt would take minutes first)."""
        tokenizer = self.host.tokenizer
        if tokenizer is None:
            raise RequestError("this checkpoint has no tokenizer.json: pass prompts as token-id lists")
        size = len(text.encode("utf-8"))
        fewest = size // tokenizer.max_token_bytes
        if fewest >= self.max_model_len:
            raise PromptTooLongError(f"prompt of {size} bytes has at least {fewest} tokens but max_model_len is "
                                     f"{self.max_model_len}")
        return tokenizer.encode(text, add_bos=add_bos)

    def encode(self, prompt: str | list[int]) -> list[int]:
        vocab_size = self.host.config.vocab_size
        if isinstance(prompt, str):
            ids = self.tokenize(prompt, add_bos=True)
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
            bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size),
                       None)
            if bad is not None:
                raise RequestError(f"prompt token {bad!r} is not an id in [0, {vocab_size})")
        else:
            raise RequestError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not ids:
            raise RequestError("prompt is empty")
        if len(ids) >= self.max_model_len:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens but max_model_len is {self.max_model_len} (room is needed to generate)"
            )
        return ids

    def check_params(self, params: SamplingParams | None) -> SamplingParams:
        """`params` (None: the defaults) once they are known to fit this engine; a request's
        `structured` constraint is compiled (and cached) here, so a bad one fails at submission."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        if params.max_tokens >= self.max_model_len:
            raise RequestError(f"max_tokens={params.max_tokens} leaves no room for a prompt: max_model_len is "
                               f"{self.max_model_len}")
        if params.stop and self.host.tokenizer is None:
            raise RequestError("stop strings need a tokenizer; use stop_token_ids with this checkpoint")
        if params.structured is not None:
            self._compiler(params).check(params.structured)
        return params

    def _compiler(self, params: SamplingParams) -> StructuredCompiler:
        if params.structured == TOOL_CALL:
            raise RequestError("structured='tool_call' is made from a conversation's tools: use chat(..., tools=..., "
                               "tool_choice=...)")
        if self.host.tokenizer is None:
            raise RequestError("structured outputs need a tokenizer: this checkpoint has no tokenizer.json")
        return self.host.compiler()

    def enqueue(self, ids: list[int], params: SamplingParams, request_id: int | None = None) -> int:
        """Queue a checked request as number `request_id` (default: the next); the counter moves past it.
        A request without a seed gets one from the engine seed and its number or its content."""
        request_id = self.next_id if request_id is None else request_id
        self.next_id = max(self.next_id, request_id + 1)
        if params.seed is not None:
            seed = params.seed
        elif self.unseeded_seeds == "request_order":
            seed = derive_seed(self.seed, request_id)
        else:
            seed = derive_seed(self.seed, request_content_hash(ids, params), CONTENT_SEEDS)
        grammar = None if params.structured is None else self._compiler(params).matcher(params.structured)
        self.scheduler.add(Sequence(request_id, ids, params, seed, grammar=grammar))
        return request_id

    # the step ------------------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self.in_flight is not None

    def step(self) -> list[RequestOutput]:
        """One engine step; returns the requests whose finish it read (with async scheduling, those
        that finished in the step before)."""
        started = time.perf_counter()
        scheduled = self.scheduler.schedule()
        before, self.in_flight = self.in_flight, None
        current = None
        capped = self.engine_config.expert_capacity is not None
        if capped:
            self._size_exchanges(scheduled)
        if scheduled.chunks:
            for exchange in self.host.exchanges:  # expert loads count the step's tokens, not its padding
                exchange.step_rows = sum(chunk.num_tokens for chunk in scheduled.chunks)
            try:
                current = (scheduled, self.runner.execute(scheduled, before[1] if before else None))
            except BaseException:  # e.g. out of device memory: the step never ran, so a retry redoes it
                self.scheduler.undo(scheduled)
                self.in_flight = before
                raise
        elif self.host.layout.lockstep:  # the other ranks' MoE layers exchange tokens with this one's
            for exchange in self.host.exchanges:
                exchange.idle()
        if capped:
            current = self._redone_if_overflowed(scheduled, current)
        finished = self._read(before) if before is not None else []
        if current is not None and self.async_scheduling and not scheduled.synchronous:
            self.in_flight = current
        elif current is not None:
            finished += self._read(current, started)
        return [self.output.request_output(seq) for seq in finished]

    def _size_exchanges(self, scheduled: SchedulerOutput) -> None:
        """Give every MoE layer's exchange the step's capacity: `expert_capacity` times a rank's even share
        of the slots the largest rank's step dispatches (its rows padded to their bucket; agreed by every
        rank, so every rank sends and receives the same sizes)."""
        rows = bucket(sum(chunk.num_tokens for chunk in scheduled.chunks)) if scheduled.chunks else 0
        layout = self.host.layout
        capacity = exchange_capacity(self.engine_config.expert_capacity, agree(rows, dist.ReduceOp.MAX),
                                     layout.attention_ranks, self.host.config.num_experts_per_tok, layout.world)
        for exchange in self.host.exchanges:
            exchange.capacity = capacity

    def _redone_if_overflowed(self, scheduled: SchedulerOutput, current: tuple | None) -> tuple | None:
        """The step as run, or, if a capacity left slots out on any rank (agreed by every rank), the step
        run again by every rank with its own sizes (before anything reads its results: its cache rows
        are rewritten, its tokens drawn again from the same logits); the redo counts no expert loads,
        the first run did."""
        counted = sum(exchange.take_overflow() for exchange in self.host.exchanges)  # summed on the device
        overflow = agree(int(counted), dist.ReduceOp.SUM)  # the step's one read of them
        if overflow == 0:
            return current
        self.num_exchange_redos += 1
        self.num_exchange_overflow_slots += overflow
        for exchange in self.host.exchanges:
            exchange.capacity, exchange.step_rows = None, 0
        if scheduled.chunks:
            return scheduled, self.runner.execute(scheduled)
        for exchange in self.host.exchanges:
            exchange.idle()
        return current

    def _read(self, step: tuple[SchedulerOutput, RunnerOutput], started: float | None = None) -> list[Sequence]:
        """Apply a step's results (waiting for them); the sequences that finished. `started`: when the
        step was queued, if it is read back at once (its wall time is then measured)."""
        scheduled, output = step
        result = output.result(scheduled)
        if result.forward_seconds is not None:
            whole = result.forward_seconds + result.draft_seconds if started is None else time.perf_counter() - started
            self.scheduler.observe_step(scheduled, result.forward_seconds, whole)
        return self.scheduler.update(scheduled, result)
