"""The checkpoint's tensor inventory: every name, shape and storage kind, derived from the config.

This is the one source of truth for the writer, the loader and the model: names are what
`DeepseekV4ForCausalLM.save_pretrained` writes, plus our `mtp.{k}.` draft blocks.
"""

from __future__ import annotations

from dataclasses import replace

from deepinfer.checkpoint.errors import CheckpointError
from deepinfer.checkpoint.layout_v41 import expected_tensors_v41, is_draft_tensor, is_optional
from deepinfer.checkpoint.quantized_v4 import quantized_layout
from deepinfer.checkpoint.tensor_spec import FP32, INDEX, MTP_PREFIX, WEIGHT, TensorSpec
from deepinfer.config import CSA, HCA, SLIDING, ModelConfig
from deepinfer.config_v41 import V41Config


def expected_tensors(config: ModelConfig | V41Config, include_mtp: bool) -> dict[str, TensorSpec]:
    """Every tensor the engine loads, quantized ones as the config's `quantization_config` stores them;
    `include_mtp` adds the draft layers (V4: our MTP blocks; V4.1: the released DSpark layers, which
    the backbone leaves unused, see `unused_tensor`)."""
    if isinstance(config, V41Config):
        return expected_tensors_v41(config, include_mtp)
    c = config
    h, hc = c.hidden_size, c.hc_mult
    out: dict[str, TensorSpec] = {
        "model.embed_tokens.weight": TensorSpec((c.vocab_size, h), WEIGHT),
        "head.weight": TensorSpec((c.vocab_size, h), WEIGHT),
        "model.norm.weight": TensorSpec((h,), FP32),
        "model.hc_head.hc_fn": TensorSpec((hc, hc * h), FP32),
        "model.hc_head.hc_base": TensorSpec((hc,), FP32),
        "model.hc_head.hc_scale": TensorSpec((1,), FP32),
    }
    for i, (layer_type, mlp_type) in enumerate(zip(c.layer_types, c.mlp_layer_types)):
        out.update(_block(f"model.layers.{i}.", c, layer_type, mlp_type))
    if include_mtp:
        for k in range(c.num_nextn_predict_layers):
            p = f"{MTP_PREFIX}{k}."
            out.update({
                p + "enorm.weight": TensorSpec((h,), FP32),
                p + "hnorm.weight": TensorSpec((h,), FP32),
                p + "e_proj.weight": TensorSpec((h, h), WEIGHT),
                p + "h_proj.weight": TensorSpec((h, h), WEIGHT),
            })
            out.update(_block(p, c, SLIDING, "moe"))
            out.update({
                p + "norm.weight": TensorSpec((h,), FP32),
                p + "hc_head_fn": TensorSpec((hc, hc * h), FP32),
                p + "hc_head_base": TensorSpec((hc,), FP32),
                p + "hc_head_scale": TensorSpec((1,), FP32),
                p + "confidence.weight": TensorSpec((1, h), WEIGHT),
                p + "confidence.bias": TensorSpec((1,), WEIGHT),
            })
    if c.quantization_config is not None:
        return quantized_layout(c, out)
    return out


def unchecked_tensor(config: ModelConfig | V41Config, name: str) -> bool:
    """A tensor a checkpoint may hold that the layout does not describe (V4.1: the vision tower and the
    routers' image-token biases; the draft layers are checked when present); V4 has none."""
    if isinstance(config, V41Config):
        return is_optional(name) and not is_draft_tensor(name)
    return False


def unused_tensor(config: ModelConfig | V41Config, name: str) -> bool:
    """A tensor a checkpoint may hold that the engine leaves unused (V4.1: the draft layers, the vision
    tower, the routers' image-token biases); V4 has none."""
    if isinstance(config, V41Config):
        return is_optional(name)
    return False


def _block(p: str, c: ModelConfig, layer_type: str, mlp_type: str) -> dict[str, TensorSpec]:
    h, hd, hc = c.hidden_size, c.head_dim, c.hc_mult
    o_rank = c.o_groups * c.o_lora_rank
    out = {
        p + "attn_norm.weight": TensorSpec((h,), FP32),
        p + "attn.wq_a.weight": TensorSpec((c.q_lora_rank, h), WEIGHT),
        p + "attn.q_norm.weight": TensorSpec((c.q_lora_rank,), FP32),
        p + "attn.wq_b.weight": TensorSpec((c.num_attention_heads * hd, c.q_lora_rank), WEIGHT),
        p + "attn.wkv.weight": TensorSpec((hd, h), WEIGHT),
        p + "attn.norm.weight": TensorSpec((hd,), FP32),
        p + "attn.wo_a.weight": TensorSpec((o_rank, c.num_attention_heads * hd // c.o_groups), WEIGHT),
        p + "attn.wo_b.weight": TensorSpec((h, o_rank), WEIGHT),
        p + "attn.attn_sink": TensorSpec((c.num_attention_heads,), FP32),
    }
    if layer_type == CSA:
        # Two overlapping series per token (width 2·rate, stride rate), hence the doubled widths.
        out.update(_compressor(p + "attn.compressor.", h, hd, 2 * hd, c.compress_rate(CSA)))
        out.update(_compressor(p + "attn.indexer.compressor.", h, c.index_head_dim,
                               2 * c.index_head_dim, c.compress_rate(CSA)))
        out.update({
            p + "attn.indexer.wq_b.weight": TensorSpec((c.index_n_heads * c.index_head_dim, c.q_lora_rank), WEIGHT),
            p + "attn.indexer.weights_proj.weight": TensorSpec((c.index_n_heads, h), WEIGHT),
        })
    elif layer_type == HCA:
        out.update(_compressor(p + "attn.compressor.", h, hd, hd, c.compress_rate(HCA)))
    e, inter = c.n_routed_experts, c.moe_intermediate_size
    out[p + "ffn_norm.weight"] = TensorSpec((h,), FP32)
    out[p + "ffn.gate.weight"] = TensorSpec((e, h), WEIGHT)
    if mlp_type == "hash_moe":
        out[p + "ffn.gate.tid2eid"] = TensorSpec((c.vocab_size, c.num_experts_per_tok), INDEX)
    else:
        out[p + "ffn.gate.bias"] = TensorSpec((e,), FP32)
    for expert in [f"ffn.experts.{j}." for j in range(e)] + ["ffn.shared_experts."]:
        out[p + expert + "w1.weight"] = TensorSpec((inter, h), WEIGHT)
        out[p + expert + "w2.weight"] = TensorSpec((h, inter), WEIGHT)
        out[p + expert + "w3.weight"] = TensorSpec((inter, h), WEIGHT)
    mix = (2 + hc) * hc  # pre (hc) + post (hc) + comb (hc × hc)
    for site in ("hc_attn_", "hc_ffn_"):
        out[p + site + "fn"] = TensorSpec((mix, hc * h), FP32)
        out[p + site + "base"] = TensorSpec((mix,), FP32)
        out[p + site + "scale"] = TensorSpec((3,), FP32)
    return out


def _compressor(p: str, hidden: int, out_dim: int, proj_dim: int, rate: int) -> dict[str, TensorSpec]:
    return {
        p + "wkv.weight": TensorSpec((proj_dim, hidden), WEIGHT),
        p + "wgate.weight": TensorSpec((proj_dim, hidden), WEIGHT),
        p + "ape": TensorSpec((rate, proj_dim), FP32),
        p + "norm.weight": TensorSpec((out_dim,), FP32),
    }


def weight_dtype_name(config: ModelConfig | V41Config) -> str | None:
    """The storage dtype of "weight" tensors that config.json declares (`dtype`), if it does."""
    name = config.extra.get("dtype")
    if name is None:
        return None
    if name not in ("float32", "bfloat16"):
        raise CheckpointError(f"config.json: field 'dtype' must be 'float32' or 'bfloat16', got {name!r}")
    return name


PARAMETER_GROUPS = ("embedding + head", "attention", "routed experts", "shared experts + routers",
                    "engram memory", "norms + hyper-connections", "mtp draft")


def parameter_group(name: str) -> str:
    if name.startswith(MTP_PREFIX):
        return "mtp draft"
    if name in ("model.embed_tokens.weight", "embed.weight", "head.weight"):
        return "embedding + head"
    if ".ffn.experts." in name:
        return "routed experts"
    if ".engram." in name:
        return "engram memory"
    if ".ffn." in name:
        return "shared experts + routers"
    if ".attn." in name and not name.endswith("norm.weight"):
        return "attention"
    return "norms + hyper-connections"


def parameter_counts(config: ModelConfig | V41Config, include_mtp: bool) -> dict[str, int]:
    """Element counts per `PARAMETER_GROUPS` entry (groups with no tensors are left out); a quantized
    checkpoint counts its weights' logical elements (not packed bytes, not scales)."""
    if config.quantization_config is not None:
        config = replace(config, quantization_config=None)
    counts: dict[str, int] = {}
    for name, spec in expected_tensors(config, include_mtp).items():
        if spec.kind == INDEX:  # routing tables are lookups, not parameters
            continue
        group = parameter_group(name)
        counts[group] = counts.get(group, 0) + spec.numel
    return {g: counts[g] for g in PARAMETER_GROUPS if g in counts}
