"""DeepSeek-V4 (`deepseek_v4`): transformers' `DeepseekV4Config` layout, its FP8 format decoded at
load, and our MTP block as its draft model (`speculation="mtp"`)."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace

import torch

from deepinfer.families.v4.layout import expected_tensors_v4
from deepinfer.families.v4.quantized import dequantize, describe
from deepinfer.families.v4.config import CSA, HCA, ModelConfig
from deepinfer.engine.draft_runner import MTPRunner
from deepinfer.families.base import Family
from deepinfer.kernels import Ops
from deepinfer.families.v4.model import DeepseekV4
from deepinfer.families.v4.mtp import MTP


def tally(items) -> str:
    """`kind xN, ...` in first-seen order (checkpoint info's layer schedules)."""
    return ", ".join(f"{kind} x{n}" for kind, n in Counter(items).items())


class V4(Family):
    model_type, config_class, name = "deepseek_v4", ModelConfig, "V4"
    speculation, draft_name = "mtp", "MTP block"
    encoding = "v4"

    def expected_tensors(self, config: ModelConfig, include_mtp: bool):
        return expected_tensors_v4(config, include_mtp)

    def weights_in_memory(self, config: ModelConfig, tensors: dict, quantized_as: torch.dtype | None) -> dict:
        return dequantize(config, tensors)  # V4's kernels take decoded weights only

    def quantized_formats(self, config: ModelConfig, weight_dtype: str) -> dict[str, str]:
        rows, cols = config.quantization("weight_block_size")
        dense = f"fp8_e4m3 {rows}x{cols} {config.quantization('scale_fmt')}"
        experts = "mxfp4 1x32 ue8m0" if config.quantization("expert_dtype") == "fp4" else dense
        return {"dense": dense, "routed_experts": experts, "other": weight_dtype}

    def has_draft(self, config: ModelConfig) -> bool:
        return config.num_nextn_predict_layers > 0

    def build_model(self, config: ModelConfig, ops: Ops, dtype: torch.dtype, device: torch.device | str = "meta",
                    cache_qdq: bool = True, engram_on_host: bool = False) -> DeepseekV4:
        return DeepseekV4(config, ops, dtype, device=device)

    def new_draft(self, config: ModelConfig, ops: Ops, dtype: torch.dtype, device: torch.device,
                  cache_qdq: bool) -> MTP:
        return MTP(config, ops, dtype, device)

    def draft_pools(self, pools: list, draft: MTP) -> list:
        """The MTP block is one more layer of the window pool."""
        return [replace(spec, layers=spec.layers + (draft.layer_id,)) if spec.name == "window" else spec
                for spec in pools]

    def draft_runner(self, draft: MTP, cache, draft_tokens: int, threshold: float) -> MTPRunner:
        return MTPRunner(draft, cache, draft_tokens, threshold)

    def architecture_lines(self, config: ModelConfig) -> list[str]:
        c = config
        return [
            f"model       DeepSeek-{self.name} ({c.model_type})",
            f"layers      {c.num_hidden_layers}: {tally(c.layer_types)}",
            f"mlp         {tally(c.mlp_layer_types)}",
            f"attention   window {c.sliding_window}, compress CSA {c.compress_rates.get(CSA, '-')} / "
            f"HCA {c.compress_rates.get(HCA, '-')}, indexer {c.index_n_heads} heads x {c.index_head_dim} "
            f"top-{c.index_topk}",
            *([f"quantized   {describe(c)}"] if c.quantization_config is not None else []),
        ]
