"""How a model's memory falls on each GPU of a layout, worked out from its config before anything is
loaded (`deepinfer plan`; an engine on a GPU checks the same plan before it loads the weights).

Per rank: the weights in the formats the engine keeps them in (`weight_storage`: as stored, FP8 and
MXFP4 with their scales, or widened to the engine's dtype), in four parts: what every rank holds
(attention, norms, routers, shared experts, embedding, head), the routed experts it holds (its
1/expert_parallel share of each MoE layer's, rounded up: the contiguous placement), V4.1's Engram
tables (on the device or in host memory, `engram_tables`: read from a checkpoint as stored, the file's
mapped pages, which a machine's ranks share) and the draft model speculation loads (its
weights widened to the engine's dtype, as the engine keeps them); the cache pools sized for
max_num_seqs sequences of max_model_len (`engine.cache.cache_bytes`, the engine's own rule: under data
parallelism each rank caches its own requests, otherwise every request it runs, and under context
parallelism every rank holds every cache); with a fixed-capacity expert exchange (`expert_capacity`), its
buffers in one MoE layer of the largest step (rows sent and received, through the experts and back, at
`parallel.experts.exchange_capacity` per rank pair); and headroom for what the plan does not model
(other activations, CUDA graph pools, the allocator's slack), `HEADROOM_FRACTION` of the card. Without a max_model_len the
plan takes the engine's default rule (`engine.cache.default_max_model_len`) over the memory the
weights and headroom leave. A layout fits when a rank's parts and headroom stay within the card.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from deepinfer import kernels
from deepinfer.engine.cache import (CACHE_MEMORY_FRACTION, cache_bytes, default_max_model_len, physical_memory,
                                    step_budget)
from deepinfer.engine.config import EngineConfig
from deepinfer.engine.drafter import DEVICE_SPECULATION
from deepinfer.errors import DeepInferError
from deepinfer.families.registry import family_of
from deepinfer.families.tensor_spec import FP4, FP8, FP32, INDEX, MTP_PREFIX, SCALE, TensorSpec
from deepinfer.model import bucket
from deepinfer.parallel.experts import exchange_capacity

HEADROOM_FRACTION = 0.10  # of the card: activations, graph pools and the allocator's slack, not modelled
GIB = 2**30
SHARED, EXPERTS, ENGRAM, DRAFT, CACHES, EXCHANGE, HEADROOM = (
    "weights every rank holds", "routed experts", "Engram tables", "draft model", "caches", "expert exchange",
    "headroom")


class PlanError(DeepInferError):
    """A layout whose per-rank memory does not fit the card."""


@dataclass(frozen=True)
class Part:
    """One part of a rank's memory: what it is, how it is stored, its bytes, and whether it sits on the
    GPU or in host memory."""

    name: str
    detail: str
    bytes: int
    on_gpu: bool = True
    per_machine: bool = False  # in host memory once for all the ranks of a machine (a checkpoint file's pages)


@dataclass
class MemoryPlan:
    """One rank's memory under `engine` (its parallel degrees, storage and cache settings) on `gpus`
    cards of `gpu_bytes` each (`on_cpu`: an engine on the CPU, whose one memory holds every part);
    `max_model_len` as planned (given, or the engine's default rule)."""

    model: str
    gpus: int
    gpu_bytes: int
    engine: EngineConfig
    max_model_len: int
    parts: list[Part]
    on_cpu: bool = False

    @property
    def gpu_total(self) -> int:
        return sum(part.bytes for part in self.parts if part.on_gpu)

    @property
    def host_total(self) -> int:
        return sum(part.bytes for part in self.parts if not part.on_gpu)

    @property
    def machine_host_total(self) -> int:
        """Host memory the `gpus` ranks of one machine need together."""
        return sum(part.bytes * (1 if part.per_machine else self.gpus) for part in self.parts if not part.on_gpu)

    def where(self) -> str:
        if self.on_cpu:
            return f"a CPU machine of {gib(self.gpu_bytes)} GiB"
        return f"{self.gpus} GPU{'s' if self.gpus > 1 else ''} of {gib(self.gpu_bytes)} GiB"

    def layout(self) -> str:
        degrees = [f"{name} {value}" for name, value in (("EP", self.engine.expert_parallel),
                                                         ("DP", self.engine.data_parallel),
                                                         ("CP", self.engine.context_parallel)) if value > 1]
        return ", ".join(degrees) or "one process"

    def overflow(self) -> str | None:
        """None when a rank fits; else one line: how much it lacks, and its largest part."""
        over = self.gpu_total - self.gpu_bytes
        if over <= 0:
            return None
        largest = max((part for part in self.parts if part.on_gpu and part.name != HEADROOM), key=lambda p: p.bytes)
        card = "its memory" if self.on_cpu else "its card"
        return (f"{self.model} on {self.where()} ({self.layout()}): a rank needs {gib(self.gpu_total)} GiB, "
                f"{gib(over)} GiB more than {card}; the largest part is {largest.name} ({gib(largest.bytes)} GiB): "
                f"{_remedy(largest.name, self.engine)}")

    def lines(self) -> list[str]:
        """The per-rank memory map, one part a line, then the totals and whether it fits."""
        width = max(len(part.name) for part in self.parts)
        out = [f"{self.model} on {self.where()} ({self.layout()}, weights {'as stored' if self.engine.keeps_weights_quantized else 'widened'}, "
               f"{self.engine.dtype}, max_model_len {self.max_model_len}, max_num_seqs {self.engine.max_num_seqs}): "
               f"per rank"]
        for part in self.parts:
            where = "" if part.on_gpu else "  (host memory, the checkpoint file's pages: one copy a machine)" \
                if part.per_machine else "  (host memory, a copy per rank)"
            out.append(f"  {part.name:<{width}}  {gib(part.bytes):>9} GiB  {part.detail}{where}")
        out.append(f"  {'GPU total':<{width}}  {gib(self.gpu_total):>9} GiB  of {gib(self.gpu_bytes)}")
        if self.host_total:
            out.append(f"  {'host total':<{width}}  {gib(self.host_total):>9} GiB  {gib(self.machine_host_total)} "
                       f"for the {self.gpus} rank{'s' if self.gpus > 1 else ''} of one machine")
        spare = self.gpu_bytes - self.gpu_total
        out.append(f"fits: {gib(spare)} GiB to spare per GPU" if spare >= 0 else
                   f"does not fit: {gib(-spare)} GiB short per GPU")
        return out


def gib(count: int) -> str:
    return f"{count / GIB:.1f}"


def _remedy(part: str, engine: EngineConfig) -> str:
    if part == EXPERTS:
        return "spread them over more processes (--expert-parallel)"
    if part == ENGRAM:
        return "keep them in host memory (--engram-tables host)" + (
            "" if engine.keeps_weights_quantized else " or as stored (--weight-storage quantized)")
    if part == CACHES:
        return "lower --max-model-len or --max-num-seqs"
    if part == DRAFT:
        return "run without the draft model (--speculation off or ngram)"
    if part == EXCHANGE:
        return "lower --expert-capacity or --max-num-batched-tokens"
    if not engine.keeps_weights_quantized:
        return "keep the weights as stored (--weight-storage quantized) or use a card with more memory"
    return "use a card with more memory"


def _bytes(spec: TensorSpec, keep_quantized: bool, itemsize: int) -> int:
    """A tensor's bytes as the engine holds it: as stored, or widened to `itemsize` (scales then go)."""
    if spec.kind == FP32:
        return 4 * spec.numel
    if spec.kind == INDEX:
        return 8 * spec.numel
    if spec.kind == FP8:
        return spec.numel * (1 if keep_quantized else itemsize)
    if spec.kind == FP4:  # an int8 holds two E2M1 codes
        return spec.numel * (1 if keep_quantized else 2 * itemsize)
    if spec.kind == SCALE:
        return spec.numel if keep_quantized else 0
    return spec.numel * itemsize


def _part_of(name: str) -> str:
    if name.startswith(MTP_PREFIX):
        return DRAFT
    if ".ffn.experts." in name:
        return EXPERTS
    if ".engram.embed." in name:
        return ENGRAM
    return SHARED


def _formats(specs: list[TensorSpec], keep_quantized: bool, dtype: str) -> str:
    """The formats a part is held in, widest share first."""
    kinds = {spec.kind for spec in specs}
    named = []
    if keep_quantized:
        named += [label for kind, label in ((FP4, "MXFP4"), (FP8, "FP8")) if kind in kinds]
        if named and SCALE in kinds:
            named[-1] += " with E8M0 scales"
    if kinds - {FP4, FP8, SCALE, FP32, INDEX} or (not keep_quantized and kinds & {FP4, FP8}):
        named.append(dtype)
    named += [label for kind, label in ((FP32, "float32"), (INDEX, "int64")) if kind in kinds]
    return ", ".join(named)


def plan_memory(model: str, config, engine: EngineConfig, gpus: int, gpu_bytes: int,
                headroom_fraction: float = HEADROOM_FRACTION, on_cpu: bool = False,
                from_files: bool = False) -> MemoryPlan:
    """The per-rank memory of `config`'s model (named `model` in the lines) served under `engine` on
    `gpus` cards of `gpu_bytes` each (the engine's parallel degrees are 1 or `gpus`), keeping
    `headroom_fraction` of each card for what the plan does not model; `on_cpu`: the engine runs on
    the CPU and `gpu_bytes` is the machine's memory, which holds every part. `from_files`: the weights
    are read from a checkpoint folder (a preset's are generated in each process), so Engram tables kept
    in host memory as stored are the files' mapped pages, one copy for a machine's ranks."""
    for name in ("expert_parallel", "data_parallel", "context_parallel"):
        if getattr(engine, name) not in (1, gpus):
            raise DeepInferError(f"{name}={getattr(engine, name)}: a degree is 1 or the number of GPUs ({gpus})")
    family = family_of(config)
    dtype = engine.torch_dtype
    keep = engine.keeps_weights_quantized and config.quantization_config is not None
    drafting = engine.speculation in DEVICE_SPECULATION
    tensors = family.expected_tensors(config, include_mtp=drafting)
    groups: dict[str, list[TensorSpec]] = {}
    for name, spec in tensors.items():
        groups.setdefault(_part_of(name), []).append(spec)
    n_experts, ep = config.n_routed_experts, engine.expert_parallel
    held = math.ceil(n_experts / ep)
    parts = []
    for part in (SHARED, EXPERTS, ENGRAM, DRAFT):
        specs = groups.get(part, [])
        if not specs:
            continue
        widen = part == DRAFT  # the draft model is built in the engine's dtype
        total = sum(_bytes(spec, keep and not widen, dtype.itemsize) for spec in specs)
        detail = _formats(specs, keep and not widen, engine.dtype)
        if part == EXPERTS:
            total = total * held // n_experts
            detail += f", {held} of {n_experts} per MoE layer"
        on_host = not on_cpu and part == ENGRAM and engine.engram_tables == "host"
        parts.append(Part(part, detail, total, on_gpu=not on_host, per_machine=on_host and from_files and keep))
    headroom = int(gpu_bytes * headroom_fraction)
    pools = _pools(family, config, engine, drafting)
    sizing = dict(max_num_seqs=engine.max_num_seqs, max_num_batched_tokens=engine.max_num_batched_tokens,
                  chunked_prefill=engine.enable_chunked_prefill, block_size=engine.block_size, itemsize=dtype.itemsize)
    max_model_len, note = engine.max_model_len, ""
    if max_model_len is None:
        left = gpu_bytes - headroom - sum(part.bytes for part in parts if part.on_gpu)
        try:
            max_model_len = default_max_model_len(pools, config.max_position_embeddings,
                                                  int(max(left, 0) * CACHE_MEMORY_FRACTION), **sizing)
        except DeepInferError:  # no room for even one block each: the least, so the plan says what overflows
            max_model_len, note = engine.block_size, " (no room left for more)"
    caches = cache_bytes(pools, max_model_len=max_model_len, **sizing)
    parts.append(Part(CACHES, f"{len(pools)} pools, {engine.max_num_seqs} sequences of {max_model_len} tokens{note}",
                      caches))
    if engine.expert_capacity is not None:
        parts.append(_exchange_part(config, engine, max_model_len))
    if headroom:
        parts.append(Part(HEADROOM, f"{headroom_fraction:.0%} of the card: activations, graph pools, allocator",
                          headroom))
    return MemoryPlan(model, gpus, gpu_bytes, engine, max_model_len, parts, on_cpu)


def _exchange_part(config, engine: EngineConfig, max_model_len: int) -> Part:
    """The fixed-capacity exchange's buffers in one MoE layer of the largest step: R = ranks x capacity
    rows sent, received, the experts' outputs, returned and laid back (each [R, hidden]), the experts'
    intermediate (gate and up, then their product: [R, 3 x intermediate]), and two expert-slot lists."""
    step = bucket(step_budget(engine.max_num_batched_tokens, max_model_len, engine.enable_chunked_prefill))
    world = engine.expert_parallel
    capacity = exchange_capacity(engine.expert_capacity, step, world // engine.data_parallel,
                                 config.num_experts_per_tok, world)
    rows = world * capacity
    total = rows * (5 * config.hidden_size + 3 * config.moe_intermediate_size) * engine.torch_dtype.itemsize + 16 * rows
    return Part(EXCHANGE, f"{capacity} rows per rank pair and MoE layer at a {step}-token step", total)


def _pools(family, config, engine: EngineConfig, drafting: bool) -> list:
    """The cache pools of the model (and its draft model) as the engine builds them, on the meta device."""
    ops = kernels.bind("fast", "cpu")
    model = family.build_model(config, ops, engine.torch_dtype, "meta", cache_qdq=engine.cache_qdq)
    pools = model.pools
    if drafting:
        draft = family.new_draft(config, ops, engine.torch_dtype, torch.device("meta"), engine.cache_qdq)
        pools = family.draft_pools(pools, draft)
    return pools


def machine_memory(device: torch.device) -> int:
    """What an engine on `device` has: the card's memory, or on the CPU the machine's."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return physical_memory()


def check_fits(plan: MemoryPlan) -> None:
    """Refuse, in one line, a plan whose rank does not fit its card."""
    problem = plan.overflow()
    if problem is not None:
        raise PlanError(problem)
