"""Named model shapes for synthetic checkpoints (`deepinfer checkpoint create --preset NAME`)."""

from __future__ import annotations

from deepinfer.checkpoint.errors import CheckpointError
from deepinfer.families.v41.presets import V41_CONFIG_ONLY, V41_PRESETS, v41_preset_config
from deepinfer.families.v4.config import CSA, HCA, SLIDING, ModelConfig
from deepinfer.families.v41.config import V41Config

PRESETS = ("tiny", "small", "flash-4l", "flash") + V41_PRESETS
# too big to write here: config.json + tokenizer.json only
CONFIG_ONLY_PRESETS = ("flash",) + V41_CONFIG_ONLY


def preset_config(name: str) -> ModelConfig | V41Config:
    """The config of preset `name`: V4 ("tiny", ...) or V4.1 ("v41-tiny", ..., `presets_v41`)."""
    if name not in PRESETS:
        raise CheckpointError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    if name in V41_PRESETS:
        return v41_preset_config(name)
    return {"tiny": _tiny, "small": _small, "flash-4l": _flash_4l, "flash": _flash}[name]()


def _config(*, dtype: str, partial_rotary_factor: float, compress_yarn_original: int,
            max_position_embeddings: int, **fields) -> ModelConfig:
    rope = {
        "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": partial_rotary_factor},
        "compress": {
            "rope_type": "yarn", "rope_theta": 160000.0, "factor": 16.0,
            "original_max_position_embeddings": compress_yarn_original,
            "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": 1.0,
            "partial_rotary_factor": partial_rotary_factor,
        },
    }
    return ModelConfig(
        num_key_value_heads=1, n_shared_experts=1, scoring_func="sqrtsoftplus", norm_topk_prob=True,
        routed_scaling_factor=1.5, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, swiglu_limit=10.0,
        num_nextn_predict_layers=1, rms_norm_eps=1e-6, rope_theta=10000.0, compress_rope_theta=160000.0,
        partial_rotary_factor=partial_rotary_factor, rope_parameters=rope,
        max_position_embeddings=max_position_embeddings,
        extra={"architectures": ["DeepseekV4ForCausalLM"], "dtype": dtype},
        **fields,
    )


def _tiny() -> ModelConfig:
    return _config(
        dtype="float32", vocab_size=1024, hidden_size=128, moe_intermediate_size=64, num_hidden_layers=4,
        layer_types=[SLIDING, CSA, HCA, CSA], mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
        num_attention_heads=4, head_dim=64, q_lora_rank=64, n_routed_experts=16, num_experts_per_tok=2,
        partial_rotary_factor=0.25, o_groups=2, o_lora_rank=32, sliding_window=32,
        compress_rates={CSA: 4, HCA: 16}, index_n_heads=16, index_head_dim=32, index_topk=16,
        max_position_embeddings=4096, compress_yarn_original=256,
    )


def _small() -> ModelConfig:
    return _config(
        dtype="float32", vocab_size=8192, hidden_size=512, moe_intermediate_size=256, num_hidden_layers=8,
        layer_types=[SLIDING] + [CSA, HCA] * 3 + [CSA], mlp_layer_types=["hash_moe"] * 2 + ["moe"] * 6,
        num_attention_heads=8, head_dim=128, q_lora_rank=256, n_routed_experts=32, num_experts_per_tok=4,
        partial_rotary_factor=0.125, o_groups=4, o_lora_rank=128, sliding_window=64,
        compress_rates={CSA: 4, HCA: 32}, index_n_heads=16, index_head_dim=64, index_topk=64,
        max_position_embeddings=16384, compress_yarn_original=1024,
    )


_FLASH_WIDTHS = dict(
    dtype="bfloat16", vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048,
    num_attention_heads=64, head_dim=512, q_lora_rank=1024, n_routed_experts=256, num_experts_per_tok=6,
    partial_rotary_factor=64 / 512, o_groups=8, o_lora_rank=1024, sliding_window=128,
    compress_rates={CSA: 4, HCA: 128}, index_n_heads=64, index_head_dim=128, index_topk=512,
    max_position_embeddings=1048576, compress_yarn_original=65536,
)


def _flash_4l() -> ModelConfig:
    return _config(num_hidden_layers=4, layer_types=[SLIDING, CSA, HCA, CSA],
                   mlp_layer_types=["hash_moe", "moe", "moe", "moe"], **_FLASH_WIDTHS)


def _flash() -> ModelConfig:
    # DeepseekV4Config's default schedules: two HCA layers, then HCA/CSA interleaved; 3 hash-MoE layers.
    n = 43
    layer_types = [HCA, HCA] + [CSA if i % 2 else HCA for i in range(n - 2)]
    return _config(num_hidden_layers=n, layer_types=layer_types,
                   mlp_layer_types=["hash_moe"] * 3 + ["moe"] * (n - 3), **_FLASH_WIDTHS)
