"""DeepSeek-V4.1 (`deepseek_v41`): the release's nested config, CSA2 roles and Engram, weights in the
release's formats (FP8 dense, MXFP4 experts, FP8 Engram tables), and the released DSpark draft
layers as its draft model (`speculation="dspark"`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace

import torch

from deepinfer.families.v41.layout import (
    dequantize, expected_tensors_v41, footprint, is_draft_tensor, is_optional, quantize, quantized_weights,
    released_format,
)
from deepinfer.families.v41.config import V41Config
from deepinfer.engine.draft_runner import DSparkRunner, draft_pool
from deepinfer.errors import DeepInferError
from deepinfer.families.base import Family
from deepinfer.families.v4.family import tally
from deepinfer.kernels import Ops
from deepinfer.families.v41.dspark import DSpark
from deepinfer.families.v41.model import DeepseekV41


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


class V41(Family):
    model_type, config_class, name = "deepseek_v41", V41Config, "V4.1"
    speculation, draft_name = "dspark", "DSpark draft layers"
    encoding = "v41"

    def expected_tensors(self, config: V41Config, include_mtp: bool):
        return expected_tensors_v41(config, include_mtp)

    def unchecked_tensor(self, config: V41Config, name: str) -> bool:
        """The vision tower and the routers' image-token biases (the draft layers are checked when present)."""
        return is_optional(name) and not is_draft_tensor(name)

    def unused_tensor(self, config: V41Config, name: str) -> bool:
        """The draft layers, the vision tower, the routers' image-token biases."""
        return is_optional(name)

    def weights_in_memory(self, config: V41Config, tensors: dict, quantized_as: torch.dtype | None) -> dict:
        if quantized_as is None:
            return dequantize(config, tensors)  # FP8 / FP4 values times powers of two: exact
        return quantized_weights(config, tensors, quantized_as)

    def quantized_formats(self, config: V41Config, weight_dtype: str) -> dict[str, str]:
        rows, cols = config.quantization_config.get("weight_block_size", [32, 32])
        return {"dense": f"fp8_e4m3 {rows}x{cols} ue8m0", "routed_experts": "mxfp4 1x32 ue8m0",
                "engram_tables": "fp8_e4m3 1x32 ue8m0", "other": weight_dtype}

    def encode_random(self, config: V41Config, tensors: Mapping[str, torch.Tensor]) -> Mapping | None:
        if config.quantization_config is None:
            return None
        return quantize(replace(config, quantization_config=None), tensors)[1]

    def released_format(self, config: V41Config) -> V41Config:
        return released_format(config)

    def has_draft(self, config: V41Config) -> bool:
        return config.num_draft_layers > 0

    def build_model(self, config: V41Config, ops: Ops, dtype: torch.dtype, device: torch.device | str = "meta",
                    cache_qdq: bool = True, engram_on_host: bool = False) -> DeepseekV41:
        """With the release's cache formats unless `cache_qdq` is false, the Engram tables in host memory
        with `engram_on_host`."""
        return DeepseekV41(config, ops, dtype, device=device, cache_qdq=cache_qdq, engram_on_host=engram_on_host)

    def use_tokenizer(self, model: DeepseekV41, tokenizer) -> None:
        if model.config.engram_layer_ids:
            if tokenizer is None:
                raise DeepInferError("this V4.1 checkpoint has Engram layers, whose hashes need its tokenizer.json")
            model.use_tokenizer(tokenizer.backend)

    def new_draft(self, config: V41Config, ops: Ops, dtype: torch.dtype, device: torch.device,
                  cache_qdq: bool) -> DSpark:
        return DSpark(config, ops, dtype, device, cache_qdq=cache_qdq)

    def draft_pools(self, pools: list, draft: DSpark) -> list:
        """DSpark's KV has a pool of its own."""
        return pools + [draft_pool(draft)]

    def draft_runner(self, draft: DSpark, cache, draft_tokens: int, threshold: float) -> DSparkRunner:
        return DSparkRunner(draft, cache, threshold)

    def architecture_lines(self, config: V41Config) -> list[str]:
        c = config
        roles, parts = c.roles, footprint(c)
        candidate = next((i for i, r in enumerate(roles) if r.candidate_source), None)
        return [
            f"model       DeepSeek-{self.name} ({c.model_type})",
            f"layers      {c.num_hidden_layers}: {tally(f'{r.kind} r{r.ratio}' if r.ratio else r.kind for r in roles)}",
            f"attention   window {c.sliding_window}, KV sources {c.kv_source_layer_ids}, indexer {c.index_n_heads} "
            f"heads x {c.index_head_dim} top-{c.index_topk}, candidate pool "
            + (f"from layer {candidate} ({c.candidate_topk_blocks} blocks of {c.candidate_block_size})"
               if candidate is not None else "off"),
            f"engram      layers {c.engram_layer_ids}, tables {c.engram_num_embeddings} rows x {c.engram_head_dim}",
            f"footprint   {_gib(sum(parts.values()))} in the release's formats (backbone): "
            + ", ".join(f"{part} {_gib(n)}" for part, n in parts.items()),
        ]
