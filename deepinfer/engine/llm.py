"""The user-facing engine: `LLM(...).generate(prompts, params)`.

Data flows one way: request -> scheduler -> runner -> model -> sampler -> output. `LLM` owns
intake and the loop; one step is `Scheduler.schedule()`, `ModelRunner.execute()`, then
`Scheduler.update()` (the scheduler owns every change to a queued sequence). With async scheduling
the update of a step comes after the next step is queued, so the host schedules and prepares step
t + 1 while the device runs step t.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import torch

from deepinfer import kernels
from deepinfer.kernels.cpu_isa import CpuIsaError
from deepinfer.kernels.selftest import CpuInvarianceError, checked_cpu_ops
from deepinfer.checkpoint import CheckpointError, default_checkpoint, load_checkpoint, preset_config
from deepinfer.checkpoint.layout import weight_dtype_name
from deepinfer.checkpoint.layout_v41 import is_draft_tensor
from deepinfer.checkpoint.loader import load_draft_tensors, load_mtp_tensors, stored_formats, weights_in_memory
from deepinfer.checkpoint.random_init import stored_random_tensors
from deepinfer.config import ModelConfig
from deepinfer.config_v41 import V41Config
from deepinfer.engine.cache import CacheManager, cache_memory, default_max_model_len, step_budget
from deepinfer.engine.config import DTYPES, EngineConfig, parse_device
from deepinfer.engine.draft_runner import device_drafts, draft_pools
from deepinfer.engine.drafter import DEVICE_SPECULATION, build_drafter
from deepinfer.engine.output import OutputProcessor
from deepinfer.engine.prefix import PrefixCache
from deepinfer.engine.runner import ModelRunner, RunnerOutput
from deepinfer.engine.scheduler import Scheduler, SchedulerOutput
from deepinfer.engine.sequence import Sequence
from deepinfer.engine.structured import Matcher, StructuredCompiler
from deepinfer.errors import DeepInferError
from deepinfer.model import DeepseekV41, build_model
from deepinfer.model.dspark import DSpark
from deepinfer.model.mtp import MTP
from deepinfer.outputs import RequestOutput
from deepinfer.parallel import ExpertPlacement, agree, gather_objects, move_experts, spread_experts, start_layout
from deepinfer.parallel.placement import held_tensors
from deepinfer.parallel.context import ContextGroup
from deepinfer.recipe.chat import ChatFormatError, ChatPrompt, parse_completion, render_chat, tool_call_constraint
from deepinfer.recipe.tokenizer import TextTokenizer, build_tokenizer
from deepinfer.sampling_params import (
    CONTENT_SEEDS,
    TOOL_CALL,
    SamplingParams,
    derive_seed,
    request_content_hash,
)

PRESET_PREFIX = "preset:"
# the engine settings that decide how the model is built and loaded (`LLM.with_engine` keeps them)
MODEL_SETTINGS = ("device", "dtype", "numerics", "cache_qdq", "weight_storage", "engram_tables", "expert_parallel",
                  "data_parallel", "context_parallel")


class RequestError(DeepInferError, ValueError):
    """A prompt the engine cannot serve."""


class PromptTooLongError(RequestError):
    """A prompt longer than the engine's limits allow."""

    kind = "prompt_too_long"


def _model_settings(config: EngineConfig) -> dict:
    """`MODEL_SETTINGS` as they take effect (aliases and `auto` resolved), so equal means the same model."""
    return {"device": parse_device(config.device), "dtype": config.torch_dtype, "numerics": config.numerics,
            "cache_qdq": config.cache_qdq, "weight_storage": config.keeps_weights_quantized,
            "engram_tables": config.engram_tables, "expert_parallel": config.expert_parallel,
            "data_parallel": config.data_parallel, "context_parallel": config.context_parallel}


class LLM:
    """An offline engine over one checkpoint, run as an `EngineConfig` says (`config=`, or its fields
    as keyword arguments).

    `model` is a checkpoint folder, None for the embedded default (`DEFAULT_PRESET`), or `"preset:NAME"` for
    seeded random weights of a preset built directly on `device` (nothing written to disk).
    `numerics="batch_invariant"` (default) makes each request's tokens and logprob bits independent
    of batching and scheduling; `"fast"` uses plain library kernels and does not promise that.

    `max_model_len=None` (default) takes the context from the model (one rule,
    `deepinfer.engine.cache.default_max_model_len`): its max_position_embeddings, or, when the default
    cache for `max_num_seqs` sequences of that length does not fit in half the memory left after the
    weights (CUDA: free device memory; CPU: physical RAM minus the weights), the largest multiple of
    `block_size` that fits. `self.max_model_len` is the resolved value (runs record it).
    With `enable_chunked_prefill=False` a prompt cannot be split, so the step budget
    (`self.max_num_batched_tokens`) is raised to at least max_model_len.

    A request without `SamplingParams.seed` gets one derived from the engine `seed` and:
    `unseeded_seeds="request_order"` (default, what vLLM-style engines do) the engine's request
    counter, so it depends on how many requests the engine served before; `"content"` a SHA-256 of
    the request (prompt token ids and sampling params), so the same unseeded request draws the same
    tokens whatever came before it or beside it. Either way the seed is in the output
    (`RequestOutput.seed`), so any output can be reproduced by passing it back.
    """

    def __init__(self, model: str | Path | None = None, config: EngineConfig | None = None, **settings) -> None:
        if config is not None and settings:
            raise DeepInferError(f"pass engine settings either as config= or as keywords, not both "
                                 f"(got config and {', '.join(sorted(settings))})")
        if config is None:
            config = EngineConfig.from_dict(settings, where="LLM")
        self.device, self.dtype = config.torch_device, config.torch_dtype
        self.numerics = config.numerics
        if config.numerics == "batch_invariant" and self.device.type == "cpu":
            try:
                ops = checked_cpu_ops(self.dtype)  # the primitives, measured on this CPU
            except (CpuIsaError, CpuInvarianceError) as err:
                raise DeepInferError(str(err)) from None
        else:
            ops = kernels.bind(config.numerics, self.device)
        self.layout = start_layout(config.expert_parallel, config.data_parallel, config.context_parallel, self.device)
        quantized_as = self.dtype if config.keeps_weights_quantized else None
        self.weight_storage = "quantized" if quantized_as is not None else "decoded"
        self._source, self._quantized_as, self._load_seed = model, quantized_as, config.seed
        self._draft_models: dict[str, DSpark | MTP] = {}  # by speculation, once an engine speculates with it
        self._structured: StructuredCompiler | None = None  # once a request is constrained
        model_config, tensors, self.tokenizer, self.model_id, self.stored_formats = self._load(model, quantized_as, config.seed)
        self.config: ModelConfig | V41Config = model_config
        self._check_max_model_len(config)  # before the weights load, so a bad setting fails fast
        self.model = build_model(model_config, ops, self.dtype,
                                 cache_qdq=config.cache_qdq, engram_on_host=config.engram_tables == "host")
        self._exchanges = spread_experts(self.model, self.layout, self.device) if self.layout.expert_parallel > 1 else []
        if self.layout.context_parallel > 1:
            self.model.context = ContextGroup(self.layout.rank, self.layout.world)
        self.model.load_tensors(tensors, self.device)
        if isinstance(self.model, DeepseekV41) and model_config.engram_layer_ids:
            if self.tokenizer is None:
                raise DeepInferError("this V4.1 checkpoint has Engram layers, whose hashes need its tokenizer.json")
            self.model.use_tokenizer(self.tokenizer.backend)
        del tensors
        self._start_engine(config)

    def with_engine(self, config: EngineConfig) -> LLM:
        """Another engine over this one's loaded model (the weights are shared, nothing is reloaded),
        run as `config` says: its scheduling, cache and seed settings may differ, the settings that
        decide how the model was built (`MODEL_SETTINGS`) may not. Serve with one of them at a time."""
        built, wanted = _model_settings(self._requested), _model_settings(config)
        changed = [name for name in MODEL_SETTINGS if wanted[name] != built[name]]
        if changed:
            raise DeepInferError(f"with_engine: {changed[0]} decides how the model was built "
                                 f"({getattr(self._requested, changed[0])!r}); load the model again to change it")
        other = object.__new__(LLM)
        for name in ("device", "dtype", "numerics", "weight_storage", "tokenizer", "model_id", "stored_formats",
                     "config", "model", "_source", "_quantized_as", "_load_seed", "_draft_models", "_structured",
                     "layout", "_exchanges"):
            setattr(other, name, getattr(self, name))
        other._start_engine(config)
        return other

    def _start_engine(self, config: EngineConfig) -> None:
        """Everything of an engine but its model: cache, scheduler, runner and output, as `config` says
        (resolved: `max_model_len` and `weight_storage` filled in, `async_scheduling` off where the
        Engram tables are in host memory or drafts are made)."""
        self._requested = config
        self.seed, self.unseeded_seeds = config.seed, config.unseeded_seeds
        config = replace(config, weight_storage=self.weight_storage)
        if self.model.engram_tokens is not None and self.model.engram_on_host:
            # the step's Engram rows are gathered on the host from its tokens: no step can be queued
            # before the tokens of the one before are read
            config = replace(config, async_scheduling=False)
        if config.speculation != "off":  # a sequence's drafts follow its last token, which must be known
            config = replace(config, async_scheduling=False)
        if self.layout.lockstep:  # MoE exchanges read their sizes on the host, splits upload rows: no graphs
            config = replace(config, cuda_graphs=False)
        self._check_max_model_len(config)
        draft = None
        if config.speculation in DEVICE_SPECULATION:
            draft = self._draft_model(config.speculation, config.cache_qdq)
            if draft.max_drafts is not None and config.draft_tokens > draft.max_drafts:
                raise DeepInferError(f"draft_tokens={config.draft_tokens}: the checkpoint's {config.speculation} "
                                     f"draft model proposes at most {draft.max_drafts} tokens per step")
        self.pools = draft_pools(self.model.pools, draft) if draft is not None else self.model.pools
        if config.max_model_len is None:  # ranks sharing requests must make the same steps: the same cache
            config = replace(config, max_model_len=agree(self._default_max_model_len(config)))
        self.engine_config = config
        self.max_model_len = config.max_model_len
        self.max_num_batched_tokens = step_budget(config.max_num_batched_tokens, self.max_model_len,
                                                  config.enable_chunked_prefill)
        self.cache = CacheManager(
            self.pools, max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len, max_step_tokens=self.max_num_batched_tokens,
            num_blocks=config.num_cache_blocks, block_size=config.block_size, dtype=self.dtype, device=self.device,
        )
        self.output = OutputProcessor(self.tokenizer, self.config.eos_token_ids, self.max_model_len, config.numerics)
        self.scheduler = Scheduler(
            self.cache, self.output, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens, chunked_prefill=config.enable_chunked_prefill,
            drafter=build_drafter(config.speculation), draft_tokens=config.draft_tokens,
            prefix=PrefixCache(self.cache) if config.prefix_caching else None,
        )
        drafts = None
        if draft is not None:
            drafts = device_drafts(draft, self.cache, config.draft_tokens, config.draft_confidence)
        self.runner = ModelRunner(self.model, self.cache, self.device, cuda_graphs=config.cuda_graphs, drafts=drafts)
        self.async_scheduling = config.async_scheduling
        self._in_flight: tuple[SchedulerOutput, RunnerOutput] | None = None
        self._next_id = 0

    def _check_max_model_len(self, config: EngineConfig) -> None:
        if config.max_model_len is not None and config.max_model_len > self.config.max_position_embeddings:
            raise DeepInferError(f"max_model_len={config.max_model_len} exceeds the model's "
                                 f"max_position_embeddings={self.config.max_position_embeddings}")

    def _default_max_model_len(self, config: EngineConfig) -> int:
        """See the class docstring; called once the weights are loaded (they count against memory)."""
        weights = itertools.chain(self.model.parameters(), self.model.buffers())
        weight_bytes = sum(t.numel() * t.element_size() for t in weights)
        return default_max_model_len(
            self.pools, self.config.max_position_embeddings,
            cache_memory(self.device, weight_bytes), max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, chunked_prefill=config.enable_chunked_prefill,
            block_size=config.block_size, itemsize=self.dtype.itemsize,
        )

    def _load(self, model: str | Path | None, quantized_as: torch.dtype | None, seed: int):
        """(model config, tensors as `weights_in_memory` gives them, tokenizer, model id, stored formats);
        a preset's weights are seeded with the engine's `seed` (under expert parallelism, only the
        routed experts this rank holds are generated)."""
        if isinstance(model, str) and model.startswith(PRESET_PREFIX):
            config = preset_config(model[len(PRESET_PREFIX):])
            # a quantized preset is generated as its checkpoint is written, in the checkpoint's dtype
            dtype = self.dtype if config.quantization_config is None else DTYPES[weight_dtype_name(config) or "float32"]
            stored = stored_random_tensors(config, seed, dtype, device=self.device, include_mtp=False)
            needed = (held_tensors(config.n_routed_experts, self.layout.rank, self.layout.world)
                      if self.layout.expert_parallel > 1 else lambda name: True)
            tensors = {name: stored[name] for name in stored if needed(name)}  # generated here, a rank its share
            formats = stored_formats(config, str(dtype).removeprefix("torch."))
            tokenizer = TextTokenizer(build_tokenizer(config.vocab_size))
            tensors = weights_in_memory(config, tensors, quantized_as)
            return config, tensors, tokenizer, f"{model}:seed={seed}", formats
        folder = Path(model) if model is not None else default_checkpoint()
        checkpoint = load_checkpoint(folder, device=self.device, quantized_as=quantized_as)
        tokenizer = TextTokenizer.from_folder(folder) if checkpoint.tokenizer_path else None
        return checkpoint.config, checkpoint.tensors, tokenizer, checkpoint.content_hash, checkpoint.formats

    def _draft_model(self, speculation: str, cache_qdq: bool) -> DSpark | MTP:
        """The checkpoint's draft layers that `speculation` runs (V4.1's DSpark layers, V4's MTP block),
        loaded once per model (engines from `with_engine` share them)."""
        if speculation not in self._draft_models:
            draft = self._new_draft(speculation, cache_qdq)
            draft.load_tensors(self._draft_tensors(speculation), self.device)
            draft.share(self.model)
            self._draft_models[speculation] = draft
        return self._draft_models[speculation]

    def _new_draft(self, speculation: str, cache_qdq: bool) -> DSpark | MTP:
        """The draft model `speculation` runs, its weights not loaded; refused for a checkpoint without it."""
        config = self.config
        if speculation == "dspark":
            if not isinstance(config, V41Config) or not config.num_draft_layers:
                raise DeepInferError("speculation=dspark needs a V4.1 checkpoint with DSpark draft layers "
                                     f"(mtp.*); {self.model_id} has none")
            return DSpark(config, self.model.ops, self.dtype, self.device, cache_qdq=cache_qdq)
        if isinstance(config, V41Config):
            raise DeepInferError(f"speculation=mtp runs a V4 checkpoint's MTP block; {self.model_id} is V4.1 "
                                 "(its draft layers run with speculation=dspark)")
        if not config.num_nextn_predict_layers:
            raise DeepInferError(f"speculation=mtp needs a V4 checkpoint with an MTP block (mtp.*); "
                                 f"{self.model_id} has none")
        return MTP(config, self.model.ops, self.dtype, self.device)

    def _draft_tensors(self, speculation: str) -> dict:
        """The draft layers' tensors as `weights_in_memory` gives them (a preset's seeded like its backbone)."""
        source, quantized_as = self._source, self._quantized_as
        if isinstance(source, str) and source.startswith(PRESET_PREFIX):
            config = self.config
            dtype = self.dtype if config.quantization_config is None else DTYPES[weight_dtype_name(config) or "float32"]
            stored = stored_random_tensors(config, self._load_seed, dtype, device=self.device, include_mtp=True)
            tensors = {name: stored[name] for name in stored if is_draft_tensor(name)}
            return weights_in_memory(config, tensors, quantized_as)
        load = load_draft_tensors if speculation == "dspark" else load_mtp_tensors
        try:
            return load(Path(source) if source is not None else default_checkpoint(), self.device,
                        quantized_as=quantized_as)
        except CheckpointError as err:
            raise DeepInferError(str(err)) from None

    # requests in -------------------------------------------------------------------------------

    def tokenize(self, text: str | ChatPrompt, add_bos: bool = False) -> list[int]:
        """Token ids of `text` (a rendered chat prompt's client text is encoded as text, and it brings
        its own BOS). A text too long for max_model_len even if every token were the tokenizer's
        longest is refused before tokenizing (a huge prompt would take minutes first)."""
        if self.tokenizer is None:
            raise RequestError("this checkpoint has no tokenizer.json: pass prompts as token-id lists")
        size = len((text.text if isinstance(text, ChatPrompt) else text).encode("utf-8"))
        fewest = size // self.tokenizer.max_token_bytes
        if fewest >= self.max_model_len:
            raise PromptTooLongError(f"prompt of {size} bytes has at least {fewest} tokens but max_model_len is "
                                     f"{self.max_model_len}")
        if isinstance(text, ChatPrompt):
            return text.token_ids(self.tokenizer)
        return self.tokenizer.encode(text, add_bos=add_bos)

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenize(prompt, add_bos=True)
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
            bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool)
                        or not 0 <= t < self.config.vocab_size), None)
            if bad is not None:
                raise RequestError(f"prompt token {bad!r} is not an id in [0, {self.config.vocab_size})")
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
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer; use stop_token_ids with this checkpoint")
        if params.structured is not None:
            self._compiler(params).check(params.structured)
        return params

    def _compiler(self, params: SamplingParams) -> StructuredCompiler:
        """The compiler of constraints like the request's (made on first use)."""
        if params.structured == TOOL_CALL:
            raise RequestError("structured='tool_call' is made from a conversation's tools: use chat(..., tools=..., "
                               "tool_choice=...)")
        if self.tokenizer is None:
            raise RequestError("structured outputs need a tokenizer: this checkpoint has no tokenizer.json")
        if self._structured is None:
            self._structured = StructuredCompiler(self.tokenizer)
        return self._structured

    def _matcher(self, params: SamplingParams) -> Matcher | None:
        """A fresh matcher of the request's `structured` constraint (None without one), once
        `check_params` has compiled it."""
        return None if params.structured is None else self._compiler(params).matcher(params.structured)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: int | None = None) -> int:
        """Queue one request as number `request_id` (default: the next; ranks serving shares of one
        list give each request the same number); it joins the running batch at the next `step()`."""
        return self._enqueue(self.encode(prompt), self.check_params(params), request_id)

    def _enqueue(self, ids: list[int], params: SamplingParams, request_id: int | None = None) -> int:
        """Queue a request as number `request_id` (default: the next); the counter moves past it."""
        request_id = self._next_id if request_id is None else request_id
        self._next_id = max(self._next_id, request_id + 1)
        seed = params.seed if params.seed is not None else self._unseeded_seed(request_id, ids, params)
        self.scheduler.add(Sequence(request_id, ids, params, seed, grammar=self._matcher(params)))
        return request_id

    def _unseeded_seed(self, request_id: int, ids: list[int], params: SamplingParams) -> int:
        """The seed of a request that brought none (see `unseeded_seeds` in the class docstring)."""
        if self.unseeded_seeds == "request_order":
            return derive_seed(self.seed, request_id)
        return derive_seed(self.seed, request_content_hash(ids, params), CONTENT_SEEDS)

    # the loop ----------------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix, freeing the blocks only the prefix cache held (requests in
        flight keep theirs): the next requests compute their prompts in full."""
        self.scheduler.reset_prefix_cache()

    def step(self) -> list[RequestOutput]:
        """One engine step; returns the requests whose finish it read (with async scheduling, those
        that finished in the step before)."""
        scheduled = self.scheduler.schedule()
        before, self._in_flight = self._in_flight, None
        current = None
        if scheduled.chunks:
            try:
                current = (scheduled, self.runner.execute(scheduled, before[1] if before else None))
            except BaseException:  # e.g. out of device memory: the step never ran, so a retry redoes it
                self.scheduler.undo(scheduled)
                self._in_flight = before
                raise
        elif self.layout.lockstep:  # the other ranks' MoE layers exchange tokens with this one's
            for exchange in self._exchanges:
                exchange.idle()
        finished = self._read(before) if before is not None else []
        if current is not None and self.async_scheduling:
            self._in_flight = current
        elif current is not None:
            finished += self._read(current)
        return [self.output.request_output(seq) for seq in finished]

    def _read(self, step: tuple[SchedulerOutput, RunnerOutput]) -> list[Sequence]:
        """Apply a step's results (waiting for them); the sequences that finished."""
        scheduled, output = step
        return self.scheduler.update(scheduled, output.result(scheduled))

    # batch APIs ---------------------------------------------------------------------------------

    def stream(self, arrive: Callable[[], bool] | None = None) -> Iterator[list[RequestOutput]]:
        """The engine loop: step until no rank has work, yielding the requests each step finished, every
        rank's (a launch of several processes gathers them after each step, one copy per group of ranks
        that share requests; a rank with nothing to run still steps while others work, in lockstep).
        `arrive`, called before each step, may queue requests and says whether more are still to
        come (they count as work)."""
        while True:
            working = (arrive is not None and arrive()) or self.has_unfinished()
            finished = self.step() if working or self.layout.lockstep else []
            if self.layout.world > 1:
                shares = gather_objects((working, finished))
                working = any(share[0] for share in shares)
                finished = [output for share in shares[::self.layout.attention_ranks] for output in share[1]]
            yield finished
            if not working:
                return

    def generate(
        self, prompts: list[str] | list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[RequestOutput]:
        """Run all prompts to completion; outputs come back in prompt order."""
        if self.has_unfinished():
            raise RequestError("generate() needs an idle engine: finish requests queued with add_request() via step()")
        ids = self.submit(prompts, params)
        done = {output.request_id: output for finished in self.stream() for output in finished}
        return [done[i] for i in ids]

    def submit(
        self, prompts: list[str] | list[list[int]], params: SamplingParams | list[SamplingParams] | None = None
    ) -> list[int]:
        """Queue every prompt, all checked first (a bad one queues none); their request ids, in prompt
        order. Every rank of a launch is given every prompt and queues its share (all of them unless
        data parallel), under ids the ranks agree on."""
        if not isinstance(prompts, list):
            raise RequestError("prompts must be a list (of strings or of token-id lists)")
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise RequestError(f"got {len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        encoded = [self.encode(p) for p in prompts]
        checked = [self.check_params(sp) for sp in per_prompt]
        ids = [self._next_id + i for i in range(len(prompts))]
        for index, (p, sp) in enumerate(zip(encoded, checked)):
            if self.layout.serves(index):  # every request, unless data parallel gives each rank a share
                self._enqueue(p, sp, ids[index])
        self._next_id = ids[-1] + 1 if ids else self._next_id
        return ids

    def expert_loads(self) -> list[list[int]]:
        """Per MoE layer, the slots each expert received from every rank's tokens since the last call
        (a collective; [] without expert parallelism): what `deepinfer.parallel.balanced_placement`
        balances."""
        return [exchange.take_loads().tolist() for exchange in self._exchanges]

    @property
    def expert_placements(self) -> list[ExpertPlacement]:
        """Where each MoE layer's experts are now ([] without expert parallelism)."""
        return [exchange.placement for exchange in self._exchanges]

    def place_experts(self, placements: list[ExpertPlacement]) -> None:
        """Move the experts to `placements` (one per MoE layer) between steps: the weights travel
        between ranks and routing follows (a collective). Outputs stay the same bits."""
        if not self._exchanges:
            raise DeepInferError("place_experts needs expert parallelism (expert_parallel > 1)")
        if self._in_flight is not None:
            raise DeepInferError("place_experts between steps: a step is in flight")
        if len(placements) != len(self._exchanges):
            raise DeepInferError(f"{len(placements)} placements for {len(self._exchanges)} MoE layers")
        for exchange, placement in zip(self._exchanges, placements):
            move_experts(exchange, placement)

    def chat(
        self,
        conversations: list[list[dict]],
        params: SamplingParams | list[SamplingParams] | None = None,
        tools: list[dict] | None = None,
        thinking: bool = False,
        tool_choice: str | dict | None = None,
    ) -> list[RequestOutput]:
        """Generate the next assistant turn of each conversation (OpenAI Chat Completions messages);
        each output carries the parsed assistant `message` (content, reasoning, tool_calls). A request
        whose params say `structured="tool_call"` is constrained to tool calls of `tools` as
        `tool_choice` allows ("required" or a named function: `recipe.chat.tool_call_constraint`)."""
        if self.tokenizer is None:
            raise RequestError("chat needs a tokenizer: this checkpoint has no tokenizer.json")
        prompts = []
        for i, messages in enumerate(conversations):
            try:
                prompts.append(self.tokenize(render_chat(messages, tools=tools, thinking=thinking)))
            except ChatFormatError as err:
                raise ChatFormatError(f"conversation {i}: {err}") from None
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        if any(p is not None and p.structured == TOOL_CALL for p in per_prompt):
            constraint = tool_call_constraint(tools, tool_choice, thinking)
            per_prompt = [replace(p, structured=constraint) if p is not None and p.structured == TOOL_CALL else p
                          for p in per_prompt]
        outputs = self.generate(prompts, per_prompt)
        for output in outputs:
            output.message = parse_completion(output.text, thinking=thinking)
        return outputs
