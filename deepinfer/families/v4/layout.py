"""DeepSeek-V4's tensor inventory: every name, shape and storage kind, derived from its config.

Names are what `DeepseekV4ForCausalLM.save_pretrained` writes, plus our `mtp.{k}.` draft blocks; a
config declaring transformers' FP8 format stores its weights as `families/v4/quantized.py` says.
"""

from __future__ import annotations

from deepinfer.families.v4.quantized import quantized_layout
from deepinfer.families.tensor_spec import FP32, INDEX, MTP_PREFIX, WEIGHT, TensorSpec
from deepinfer.families.v4.config import CSA, HCA, SLIDING, ModelConfig


def expected_tensors_v4(config: ModelConfig, include_mtp: bool) -> dict[str, TensorSpec]:
    """Every tensor of a V4 checkpoint, quantized ones as its `quantization_config` stores them;
    `include_mtp` adds our MTP draft blocks."""
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
