"""DeepSeek-V4 checkpoints in transformers' quantized FP8 format (`quantization_config` from
`FineGrainedFP8Config`, quant_method "fp8"): which weights are quantized, how they are stored, and
how they decode.

transformers quantizes every `nn.Linear` of `DeepseekV4ForCausalLM` except the LM head and those
its `_keep_in_fp32_modules` lists (the compressors' and the indexer's `kv_proj` / `gate_proj`, the
indexer's `weights_proj`), plus the routed experts; embeddings, routers, norms and hyper-connection
weights are no linears. In the checkpoint's names (`layout`) that is, in every block,
`attn.{wq_a, wq_b, wkv, wo_a, wo_b, indexer.wq_b}.weight` and
`ffn.{experts.{j}, shared_experts}.w{1,2,3}.weight`; our draft blocks (`mtp.{k}.`) follow the same
rule. Such a `<name>.weight` keeps its name and gains `<name>.weight_scale_inv`:

- FP8: float8_e4m3fn [out, in]; one scale per `weight_block_size` tile, [ceil(out/bm), ceil(in/bn)],
  float32 (`scale_fmt` "float") or float8_e8m0fnu ("ue8m0").
- FP4 (`expert_dtype` "fp4", routed experts only): int8 [out, in/2], two E2M1 codes a byte (the even
  column in the low nibble); an E8M0 scale per row and 32 columns, [out, ceil(in/32)].

Routed experts stay one tensor per expert, as in the unquantized checkpoint (transformers fuses them
into `gate_up_proj` / `down_proj` in memory only).
"""

from __future__ import annotations

import math
import re

import torch

from deepinfer.families.tensor_spec import FP4, FP8, FP32, SCALE, TensorSpec
from deepinfer.families.v4.config import ModelConfig
from deepinfer.kernels.quant import MXFP4_GROUP, fp8_block_decode, mxfp4_decode

SCALE_SUFFIX = "_scale_inv"
_QUANTIZED = re.compile(r"(?:model\.layers|mtp)\.\d+\.(?:attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)"
                        r"|ffn\.(?:experts\.\d+|shared_experts)\.w[123])\.weight")


def quantized_layout(config: ModelConfig, specs: dict[str, TensorSpec]) -> dict[str, TensorSpec]:
    """The unquantized inventory `specs` as `config.quantization_config` stores it."""
    scale_kind = SCALE if config.quantization("scale_fmt") == "ue8m0" else FP32
    out = {}
    for name, spec in specs.items():
        fmt = _format(config, name)
        if fmt is None:
            out[name] = spec
            continue
        rows, cols = spec.shape
        if fmt == FP4:
            out[name] = TensorSpec((rows, cols // 2), FP4)
            tiles = (rows, math.ceil(cols / MXFP4_GROUP))
        else:
            block_rows, block_cols = _block(config)
            out[name] = TensorSpec((rows, cols), FP8)
            tiles = (math.ceil(rows / block_rows), math.ceil(cols / block_cols))
        out[name + SCALE_SUFFIX] = TensorSpec(tiles, scale_kind)
    return out


def dequantize(config: ModelConfig, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every quantized weight decoded to fp32, its scale dropped; unquantized checkpoints pass as they are.

    E8M0 scales are powers of two, so those products are exact; a float32 scale rounds each product
    once, as transformers' `dequantize=True` load does."""
    if config.quantization_config is None:
        return tensors
    for name in [n for n in tensors if _format(config, n) is not None]:
        weight, scale = tensors[name], tensors.pop(name + SCALE_SUFFIX)
        if _format(config, name) == FP4:
            tensors[name] = mxfp4_decode(weight, scale)
        else:
            tensors[name] = fp8_block_decode(weight, scale, _block(config))
    return tensors


def describe(config: ModelConfig) -> str:
    """One line for `checkpoint info`."""
    block = "x".join(map(str, _block(config)))
    return (f"FP8 E4M3 in {block} tiles, {config.quantization('scale_fmt')} scales; routed experts "
            f"{config.quantization('expert_dtype').upper()} (transformers FineGrainedFP8)")


def _format(config: ModelConfig, name: str) -> str | None:
    if not _QUANTIZED.fullmatch(name):
        return None
    return FP4 if config.quantization("expert_dtype") == "fp4" and ".ffn.experts." in name else FP8


def _block(config: ModelConfig) -> tuple[int, int]:
    rows, cols = config.quantization("weight_block_size")
    return rows, cols
