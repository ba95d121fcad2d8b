"""The tensor inventory of a DeepSeek-V4.1 checkpoint in the released names (`embed`, `layers.{i}.*`,
`norm`, `head`, and with `include_mtp` the DSpark draft layers `mtp.{k}.*`), derived from the config:
every name, shape and storage kind (see `layout.TensorSpec`).

The release also carries a vision tower (`vision.*`, `aligner.*`, `image_*`) and the routers'
image-token biases (`ffn.gate.bias_vl`, in the draft layers too). `OPTIONAL_PREFIXES` and
`OPTIONAL_SUFFIXES` name those and the draft layers: what the backbone leaves unused. The loader
accepts them all, checks the draft layers (`is_draft_tensor`) against this layout when a checkpoint
has them, and hands them out on request (`loader.load_draft_tensors`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import replace

import torch

from deepinfer.families.tensor_spec import FP4, FP8, FP32, MTP_PREFIX, SCALE, WEIGHT, TensorSpec
from deepinfer.families.v41.config import DRAFT_ROLE, FULL, REINDEX, LayerRole, V41Config, draft_config
from deepinfer.kernels.quant import QuantizedWeight, fp8_block_encode, mxfp4_encode

OPTIONAL_PREFIXES = ("mtp.", "vision.", "aligner.", "image_")
OPTIONAL_SUFFIXES = (".ffn.gate.bias_vl",)
# the release's quantization: FP8 E4M3 dense weights with E8M0 scales per 32x32 tile, MXFP4 routed
# experts (a scale per row and 32 columns), FP8 Engram tables (a scale per row and 32 columns)
QUANTIZATION = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
                "scale_fmt": "ue8m0", "expert_dtype": "fp4"}
_QUANTIZED = re.compile(r"(?:layers\.\d+\.(?:attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)"
                        r"|ffn\.(?:shared_experts|experts\.\d+)\.w[123]|engram\.(?:embed|wkv))"
                        r"|mtp\.\d+\.(?:attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b)|ffn\.(?:shared_experts|experts\.\d+)\.w[123]"
                        r"|main_proj))\.weight")
ROW_GROUP = 32


def expected_tensors_v41(config: V41Config, include_mtp: bool = False) -> dict[str, TensorSpec]:
    """The backbone's tensors, and with `include_mtp` the draft layers' (when the config has any:
    `V41Config.num_draft_layers`)."""
    c = config
    h = c.hidden_size
    out = {
        "embed.weight": TensorSpec((c.vocab_size, h), WEIGHT),
        "head.weight": TensorSpec((c.vocab_size, h), WEIGHT),
        "norm.weight": TensorSpec((h,), FP32),
    }
    for i, role in enumerate(c.roles):
        out.update(_block(f"layers.{i}.", c, role, i))
    if include_mtp:
        out.update(_draft_layers(c))
    if c.quantization_config is None:
        return out
    quantized = {}
    for name, spec in out.items():
        quantized.update({name: spec} if _format(name) is None else _quantized_specs(name, spec, _tile(c)))
    return quantized


def scale_name(name: str) -> str:
    return name.removesuffix(".weight") + ".scale"


def dequantize(config: V41Config, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A quantized checkpoint's tensors with every quantized weight decoded (exactly) to fp32 and its
    scale dropped; a checkpoint without `quantization_config` is returned as it is."""
    return {name: value.decode() if isinstance(value, QuantizedWeight) else value
            for name, value in quantized_weights(config, tensors, torch.float32).items()}


def quantized_weights(config: V41Config, tensors: dict[str, torch.Tensor],
                      dtype: torch.dtype) -> dict[str, torch.Tensor | QuantizedWeight]:
    """A quantized checkpoint's tensors with every quantized weight and its scale held together as a
    `QuantizedWeight` that decodes to `dtype` (what the engine keeps in memory instead of the decoded
    weight); a checkpoint without `quantization_config` is returned as it is."""
    if config.quantization_config is None:
        return tensors
    tile = _tile(config)
    for name in [n for n in tensors if _format(n) is not None]:
        data, scale = tensors[name], tensors.pop(scale_name(name))
        if _format(name) == FP4:
            tensors[name] = QuantizedWeight(data, scale, "mxfp4", (1, ROW_GROUP), dtype)
        else:
            tensors[name] = QuantizedWeight(data, scale, "fp8", (1, ROW_GROUP) if ".engram.embed." in name else tile,
                                            dtype)
    return tensors


def quantize(config: V41Config, tensors: Mapping[str, torch.Tensor]) -> tuple[V41Config, Mapping[str, torch.Tensor]]:
    """The release's quantized form of a plain checkpoint: its config with `QUANTIZATION` and the tensors
    with each quantized weight encoded beside its scale (`dequantize` undoes it up to rounding).

    The tensors are a lazy mapping (`Quantized`): a weight is read from `tensors` and encoded when it or
    its scale is looked up, so a writer streaming a lazy `tensors` never holds the whole model."""
    config = released_format(config)
    return config, Quantized(tensors, _tile(config))


class Quantized(Mapping[str, torch.Tensor]):
    """`quantize`'s tensors: plain ones as they are, each quantized weight and its scale encoded on demand
    (the last pair is kept, so a weight and its scale looked up one after the other encode once)."""

    def __init__(self, plain: Mapping[str, torch.Tensor], tile: tuple[int, int]) -> None:
        self._plain, self._tile = plain, tile
        self._names = [out for name in plain for out in ((scale_name(name), name) if _format(name) else (name,))]
        self._last: tuple[str, tuple[torch.Tensor, torch.Tensor]] | None = None

    def __getitem__(self, name: str) -> torch.Tensor:
        weight = name.removesuffix(".scale") + ".weight" if name.endswith(".scale") else name
        if _format(weight) is None or weight not in self._plain:
            return self._plain[name]
        if self._last is None or self._last[0] != weight:
            tensor = self._plain[weight]
            self._last = weight, (mxfp4_encode(tensor) if _format(weight) == FP4 else fp8_block_encode(
                tensor, (1, ROW_GROUP) if ".engram.embed." in weight else self._tile))
        return self._last[1][1 if name.endswith(".scale") else 0]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def released_format(config: V41Config) -> V41Config:
    """`config` declaring the release's quantization (`QUANTIZATION`)."""
    return replace(config, quantization_config=dict(QUANTIZATION))


def _format(name: str) -> str | None:
    if not _QUANTIZED.fullmatch(name):
        return None
    return FP4 if ".ffn.experts." in name else FP8


def _tile(config: V41Config) -> tuple[int, int]:
    block = config.quantization_config.get("weight_block_size", [32, 32])
    return int(block[0]), int(block[1])


def _quantized_specs(name: str, spec: TensorSpec, tile: tuple[int, int]) -> dict[str, TensorSpec]:
    rows, cols = spec.shape
    if _format(name) == FP4:
        return {name: TensorSpec((rows, cols // 2), FP4), scale_name(name): TensorSpec((rows, math.ceil(cols / ROW_GROUP)), SCALE)}
    if ".engram.embed." in name:
        tile = (1, ROW_GROUP)
    return {name: TensorSpec((rows, cols), FP8),
            scale_name(name): TensorSpec((math.ceil(rows / tile[0]), math.ceil(cols / tile[1])), SCALE)}


def is_optional(name: str) -> bool:
    """A released tensor the backbone does not use: draft layers, vision, image-token routing."""
    return name.startswith(OPTIONAL_PREFIXES) or name.endswith(OPTIONAL_SUFFIXES)


def is_draft_tensor(name: str) -> bool:
    """One of the DSpark draft layers' tensors that `expected_tensors_v41(include_mtp=True)` lists (their
    routers' image-token biases stay optional, as the backbone's do)."""
    return name.startswith(MTP_PREFIX) and not name.endswith(OPTIONAL_SUFFIXES)


def _draft_layers(c: V41Config) -> dict[str, TensorSpec]:
    """`mtp.{k}.*`: a window-only block per draft layer (with the draft's experts); `main_proj` and
    `main_norm` on the first, the final `norm`, Markov head and confidence head on the last."""
    layers = c.num_draft_layers
    if not layers:
        return {}
    h, rank, draft = c.hidden_size, c.dspark_markov_rank, draft_config(c)
    out = {}
    for k in range(layers):
        p = f"{MTP_PREFIX}{k}."
        out.update(_block(p, draft, DRAFT_ROLE, c.num_hidden_layers + k))
        if k == 0:
            out[p + "main_proj.weight"] = TensorSpec((h, len(c.dspark_target_layer_ids) * h), WEIGHT)
            out[p + "main_norm.weight"] = TensorSpec((h,), FP32)
        if k == layers - 1:
            out[p + "norm.weight"] = TensorSpec((h,), FP32)
            out[p + "markov_head.embed.weight"] = TensorSpec((c.vocab_size, rank), WEIGHT)
            out[p + "markov_head.head.weight"] = TensorSpec((c.vocab_size, rank), WEIGHT)
            out[p + "confidence_head.proj.weight"] = TensorSpec((1, h + rank), FP32)
    return out


def _block(p: str, c: V41Config, role: LayerRole, layer: int) -> dict[str, TensorSpec]:
    h, hd, hc, heads = c.hidden_size, c.head_dim, c.hc_mult, c.num_attention_heads
    o_rank = c.o_groups * c.o_lora_rank
    out = {
        p + "attn_norm.weight": TensorSpec((h,), FP32),
        p + "ffn_norm.weight": TensorSpec((h,), FP32),
        p + "attn.wq_a.weight": TensorSpec((c.q_lora_rank, h), WEIGHT),
        p + "attn.q_norm.weight": TensorSpec((c.q_lora_rank,), FP32),
        p + "attn.wq_b.weight": TensorSpec((heads * hd, c.q_lora_rank), WEIGHT),
        p + "attn.wkv.weight": TensorSpec((hd, h), WEIGHT),
        p + "attn.kv_norm.weight": TensorSpec((hd,), FP32),
        p + "attn.wo_a.weight": TensorSpec((o_rank, heads * hd // c.o_groups), WEIGHT),
        p + "attn.wo_b.weight": TensorSpec((h, o_rank), WEIGHT),
        p + "attn.attn_sink": TensorSpec((heads,), FP32),
    }
    if role.kind == FULL:
        out[p + "attn.compressor.wkv.weight"] = TensorSpec((hd, h), FP32)
        if role.ratio > 1:
            out[p + "attn.compressor.wgate.weight"] = TensorSpec((hd, h), FP32)
        out[p + "attn.compressor.norm.weight"] = TensorSpec((hd,), FP32)
        out[p + "attn.indexer.wk.weight"] = TensorSpec((c.index_head_dim, hd), WEIGHT)
        out[p + "attn.indexer.k_norm.weight"] = TensorSpec((c.index_head_dim,), FP32)
    if role.kind in (FULL, REINDEX):
        out[p + "attn.indexer.wq_b.weight"] = TensorSpec((c.index_n_heads * c.index_head_dim, c.q_lora_rank), WEIGHT)
        out[p + "attn.indexer.weights_proj.weight"] = TensorSpec((c.index_n_heads, h), WEIGHT)
    e, inter = c.n_routed_experts, c.moe_intermediate_size
    out[p + "ffn.gate.weight"] = TensorSpec((e, h), WEIGHT)
    out[p + "ffn.gate.bias"] = TensorSpec((e,), FP32)
    for expert in [f"ffn.experts.{j}." for j in range(e)] + ["ffn.shared_experts."]:
        out[p + expert + "w1.weight"] = TensorSpec((inter, h), WEIGHT)
        out[p + expert + "w2.weight"] = TensorSpec((h, inter), WEIGHT)
        out[p + expert + "w3.weight"] = TensorSpec((inter, h), WEIGHT)
    mix = (2 + hc) * hc
    for site in ("hc_attn_", "hc_ffn_"):
        out[p + site + "fn"] = TensorSpec((mix, hc * h), FP32)
        out[p + site + "base"] = TensorSpec((mix,), FP32)
        out[p + site + "scale"] = TensorSpec((3,), FP32)
    if role.engram:
        rows = c.engram_num_embeddings[c.engram_layer_ids.index(layer)]
        width = (c.engram_max_ngram_size - 1) * c.engram_n_heads * c.engram_head_dim
        out[p + "engram.embed.weight"] = TensorSpec((rows, c.engram_head_dim), WEIGHT)
        out[p + "engram.wkv.weight"] = TensorSpec(((hc + 1) * h, width), WEIGHT)
        out[p + "engram.q_weight"] = TensorSpec((hc, h), FP32)
        out[p + "engram.k_weight"] = TensorSpec((hc, h), FP32)
    return out


_BYTES = {FP8: 1, FP4: 1, SCALE: 1, FP32: 4}


def footprint(config: V41Config) -> dict[str, int]:
    """Bytes of the backbone stored as the release stores it (`QUANTIZATION`; bf16 where it does not
    quantize, fp32 where the layout says so), by part: dense FP8, MXFP4 experts, FP8 Engram tables,
    their E8M0 scales, bf16 and fp32 tensors. The draft layers and vision tower are not counted."""
    parts: dict[str, int] = {}
    for name, spec in expected_tensors_v41(released_format(config)).items():
        if spec.kind == SCALE:
            part = "E8M0 scales"
        elif spec.kind == FP4:
            part = "routed experts (MXFP4)"
        elif spec.kind == FP8:
            part = "Engram tables (FP8)" if ".engram.embed." in name else "dense weights (FP8)"
        else:
            part = "fp32 (norms, mixing, compressors)" if spec.kind == FP32 else "bf16 (embedding, head, routers)"
        parts[part] = parts.get(part, 0) + spec.numel * _BYTES.get(spec.kind, 2)
    return parts
