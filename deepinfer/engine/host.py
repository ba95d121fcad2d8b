"""A loaded model and what every engine over it shares: `ModelHost`.

Loading is the expensive part of an engine (reading or generating the weights, the CPU self-test,
starting the parallel layout), so it happens once per model; `LLM.with_engine` starts engines with
other scheduling and cache settings over the same host.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from pathlib import Path

import torch

from deepinfer import kernels
from deepinfer.checkpoint import CheckpointError, checkpoint_config, default_checkpoint, load_checkpoint, preset_config
from deepinfer.checkpoint.layout import weight_dtype_name
from deepinfer.families.registry import drafting_family, family_of
from deepinfer.families.v41.layout import is_draft_tensor
from deepinfer.checkpoint.loader import load_draft_tensors, load_mtp_tensors, stored_formats, weights_in_memory
from deepinfer.checkpoint.random_init import stored_random_tensors
from deepinfer.families.v4.config import ModelConfig
from deepinfer.families.v41.config import V41Config
from deepinfer.engine.cache import cache_memory, default_max_model_len
from deepinfer.engine.config import DTYPES, EngineConfig, parse_device
from deepinfer.engine.memory_plan import check_fits, machine_memory, plan_memory
from deepinfer.engine.structured import StructuredCompiler
from deepinfer.errors import DeepInferError
from deepinfer.kernels.cpu_isa import CpuIsaError
from deepinfer.kernels.selftest import CpuInvarianceError, checked_cpu_ops
from deepinfer.parallel import ExpertPlacement, move_experts, spread_experts, start_layout
from deepinfer.parallel.context import ContextGroup
from deepinfer.parallel.placement import held_tensors
from deepinfer.recipe.official import Protocol
from deepinfer.recipe.tokenizer import TextTokenizer, preset_tokenizer

PRESET_PREFIX = "preset:"


def model_reference(model: str | Path) -> str:
    """How a record names the model it ran, so that it loads again from any folder: `preset:NAME` as it
    is, a checkpoint folder by its absolute path."""
    if isinstance(model, str) and model.startswith(PRESET_PREFIX):
        return model
    return str(Path(model).resolve())
# the engine settings that decide how the model is built and loaded (engines over one host share them)
MODEL_SETTINGS = ("device", "dtype", "numerics", "cache_qdq", "weight_storage", "engram_tables", "expert_parallel",
                  "data_parallel", "context_parallel")


def _model_settings(config: EngineConfig) -> dict:
    """`MODEL_SETTINGS` as they take effect (aliases and `auto` resolved), so equal means the same model."""
    return {"device": parse_device(config.device), "dtype": config.torch_dtype, "numerics": config.numerics,
            "cache_qdq": config.cache_qdq, "weight_storage": config.keeps_weights_quantized,
            "engram_tables": config.engram_tables, "expert_parallel": config.expert_parallel,
            "data_parallel": config.data_parallel, "context_parallel": config.context_parallel}


class ModelHost:
    """One checkpoint loaded as the `MODEL_SETTINGS` of `config` say: its config, tokenizer and
    weights on the device, the numerics table (on CPU, the primitives the start self-test measured on
    this machine), the parallel layout and the experts' exchanges, the structured-output compiler and
    the draft models (each made on first use). `model` is as `LLM` takes it."""

    def __init__(self, model: str | Path | None, config: EngineConfig) -> None:
        self.built_as = config
        self.device, self.dtype, self.numerics = config.torch_device, config.torch_dtype, config.numerics
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
        self._draft_models: dict[str, object] = {}  # by speculation: the family's draft model
        self._structured: StructuredCompiler | None = None
        self._protocol: Protocol | None = None
        model_config = self._config_of(model)
        # before anything loads: refuse a model whose weights and caches cannot fit this device (or machine)
        check_fits(plan_memory(str(model) if model is not None else "the default checkpoint", model_config, config,
                               self.layout.world, machine_memory(self.device), headroom_fraction=0.0,
                               on_cpu=self.device.type == "cpu",
                               from_files=not (isinstance(model, str) and model.startswith(PRESET_PREFIX))))
        self.bytes_read = 0  # checkpoint bytes this process read (a preset's weights are generated)
        self.config: ModelConfig | V41Config = model_config
        self.family = family_of(model_config)
        self.check_max_model_len(config)  # before the weights load, so a bad setting fails fast
        self.model = self.family.build_model(model_config, ops, self.dtype, cache_qdq=config.cache_qdq,
                                             engram_on_host=config.engram_tables == "host")
        self.exchanges = spread_experts(self.model, self.layout, self.device) if self.layout.expert_parallel > 1 else []
        if self.layout.context_parallel > 1:
            self.model.context = ContextGroup(self.layout.rank, self.layout.world)
            for exchange in self.exchanges:  # expert parallelism beside it: split steps dispatch their own rows
                exchange.context = self.model.context
        # each tensor is read (or generated) where the model keeps it: host-resident ones never pass the GPU
        tensors, self.tokenizer, self.model_id, self.stored_formats = self._load(
            model, model_config, quantized_as, config.seed, lambda name: self.model.placement(name, self.device))
        self.model.load_tensors(tensors, self.device)
        self.family.use_tokenizer(self.model, self.tokenizer)

    def check_engine(self, config: EngineConfig) -> None:
        """Refuse an engine `config` whose `MODEL_SETTINGS` differ from the ones this model was built by."""
        built, wanted = _model_settings(self.built_as), _model_settings(config)
        changed = [name for name in MODEL_SETTINGS if wanted[name] != built[name]]
        if changed:
            raise DeepInferError(f"with_engine: {changed[0]} decides how the model was built "
                                 f"({getattr(self.built_as, changed[0])!r}); load the model again to change it")

    def check_max_model_len(self, config: EngineConfig) -> None:
        if config.max_model_len is not None and config.max_model_len > self.config.max_position_embeddings:
            raise DeepInferError(f"max_model_len={config.max_model_len} exceeds the model's "
                                 f"max_position_embeddings={self.config.max_position_embeddings}")

    def default_max_model_len(self, config: EngineConfig, pools: dict) -> int:
        """The context an engine gets when `config` sets none (one rule: `cache.default_max_model_len`,
        with the loaded weights counted against memory)."""
        weights = itertools.chain(self.model.parameters(), self.model.buffers())
        weight_bytes = sum(t.numel() * t.element_size() for t in weights)
        return default_max_model_len(
            pools, self.config.max_position_embeddings,
            cache_memory(self.device, weight_bytes), max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, chunked_prefill=config.enable_chunked_prefill,
            block_size=config.block_size, itemsize=self.dtype.itemsize,
        )

    def protocol(self) -> Protocol:
        """DeepSeek's protocol for this model: its family's official encoding over its tokenizer (made on
        first use); a one-line error for a checkpoint without a tokenizer or a family without one."""
        if self._protocol is None:
            if self.tokenizer is None:
                raise DeepInferError("chat needs a tokenizer: this checkpoint has no tokenizer.json")
            if self.family.encoding is None:
                raise DeepInferError(f"the {self.family.name} family has no official prompt encoding")
            self._protocol = Protocol(self.family.encoding, self.tokenizer.text)
        return self._protocol

    def compiler(self) -> StructuredCompiler:
        """The structured-output compiler over this model's tokenizer (made on first use)."""
        if self._structured is None:
            self._structured = StructuredCompiler(self.tokenizer)
        return self._structured

    def draft_model(self, speculation: str, cache_qdq: bool):
        """The checkpoint's draft layers that `speculation` runs (V4.1's DSpark layers, V4's MTP block),
        loaded once and shared by every engine that speculates with them."""
        if speculation not in self._draft_models:
            draft = self._new_draft(speculation, cache_qdq)
            draft.load_tensors(self._draft_tensors(speculation), self.device)
            draft.share(self.model)
            self._draft_models[speculation] = draft
        return self._draft_models[speculation]

    # experts across ranks ------------------------------------------------------------------------

    def expert_loads(self) -> list[list[int]]:
        """Per MoE layer, the slots each expert received from every rank's tokens since the last call
        (a collective; [] without expert parallelism): what `deepinfer.parallel.balanced_placement`
        balances."""
        return [exchange.take_loads().tolist() for exchange in self.exchanges]

    def place_experts(self, placements: list[ExpertPlacement]) -> None:
        """Move the experts to `placements` (one per MoE layer): the weights travel between ranks and
        routing follows (a collective)."""
        if not self.exchanges:
            raise DeepInferError("place_experts needs expert parallelism (expert_parallel > 1)")
        if len(placements) != len(self.exchanges):
            raise DeepInferError(f"{len(placements)} placements for {len(self.exchanges)} MoE layers")
        for exchange, placement in zip(self.exchanges, placements):
            move_experts(exchange, placement)

    # loading -----------------------------------------------------------------------------------

    @staticmethod
    def _config_of(model: str | Path | None) -> ModelConfig | V41Config:
        """The model's config alone (a preset's, or a folder's config.json)."""
        if isinstance(model, str) and model.startswith(PRESET_PREFIX):
            return preset_config(model[len(PRESET_PREFIX):])
        return checkpoint_config(Path(model) if model is not None else default_checkpoint())

    def _load(self, model: str | Path | None, config: ModelConfig | V41Config, quantized_as: torch.dtype | None,
              seed: int, placement: Callable[[str], str | torch.device]):
        """(tensors as `weights_in_memory` gives them, tokenizer, model id, stored formats) of `model`,
        whose config is `config`; a preset's weights are seeded with the engine's `seed` (under expert
        parallelism, only the routed experts this rank holds are generated)."""
        if isinstance(model, str) and model.startswith(PRESET_PREFIX):
            # a quantized preset is generated as its checkpoint is written, in the checkpoint's dtype
            dtype = self.dtype if config.quantization_config is None else DTYPES[weight_dtype_name(config) or "float32"]
            stored = stored_random_tensors(config, seed, dtype, device=self.device, include_mtp=False,
                                           placement=placement)
            needed = self._needed(config) or (lambda name: True)
            tensors = {name: stored[name] for name in stored if needed(name)}  # generated here, a rank its share
            formats = stored_formats(config, str(dtype).removeprefix("torch."))
            tokenizer = preset_tokenizer(family_of(config).encoding, config.vocab_size)
            tensors = weights_in_memory(config, tensors, quantized_as)
            return tensors, tokenizer, f"{model}:seed={seed}", formats
        folder = Path(model) if model is not None else default_checkpoint()
        checkpoint = load_checkpoint(folder, device=self.device, quantized_as=quantized_as,
                                     needed=self._needed(config), placement=placement)
        self.bytes_read = checkpoint.bytes_read
        tokenizer = TextTokenizer.from_folder(folder) if checkpoint.tokenizer_path else None
        return checkpoint.tensors, tokenizer, checkpoint.content_hash, checkpoint.formats

    def _needed(self, config: ModelConfig | V41Config):
        """Under expert parallelism, which tensors this rank holds (None: every one)."""
        if self.layout.expert_parallel == 1:
            return None
        return held_tensors(config.n_routed_experts, self.layout.rank, self.layout.world)

    def _new_draft(self, speculation: str, cache_qdq: bool):
        """The draft model `speculation` runs, built on the meta device (its weights are loaded after, as
        the target's are: nothing is allocated for parameters that loading replaces, such as experts kept
        as stored); refused for a checkpoint without it."""
        family, drafter = self.family, drafting_family(speculation)
        if family is not drafter:
            own = f" (its draft layers run with speculation={family.speculation})" if family.speculation else ""
            raise DeepInferError(f"speculation={speculation} runs a {drafter.name} checkpoint's {drafter.draft_name}; "
                                 f"{self.model_id} is {family.name}{own}")
        if not family.has_draft(self.config):
            raise DeepInferError(f"speculation={speculation} needs a {family.name} checkpoint with its "
                                 f"{family.draft_name} (mtp.*); {self.model_id} has none")
        return family.new_draft(self.config, self.model.ops, self.dtype, torch.device("meta"), cache_qdq)

    def _draft_tensors(self, speculation: str) -> dict:
        """The draft layers' tensors as `weights_in_memory` gives them (a preset's seeded like its backbone)."""
        source, quantized_as = self._source, self._quantized_as
        if isinstance(source, str) and source.startswith(PRESET_PREFIX):
            config = self.config
            dtype = self.dtype if config.quantization_config is None else DTYPES[weight_dtype_name(config) or "float32"]
            # made on the device, as the target's are (the values do not depend on it): made in host memory,
            # v41-flash-5l's 1,152 MXFP4 expert weights took minutes to encode on 16 cores
            stored = stored_random_tensors(config, self._load_seed, dtype, device=self.device, include_mtp=True)
            tensors = {name: stored[name] for name in stored if is_draft_tensor(name)}
            return weights_in_memory(config, tensors, quantized_as)
        load = load_draft_tensors if speculation == "dspark" else load_mtp_tensors
        try:
            return load(Path(source) if source is not None else default_checkpoint(), self.device,
                        quantized_as=quantized_as)
        except CheckpointError as err:
            raise DeepInferError(str(err)) from None
